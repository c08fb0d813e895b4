"""runner/faithfulness.py: deletion/insertion curves. A stable pixel order (saliency, then a seeded per-sample
tie-break, as numpy's lexsort), the `degenerate` and `constant_logits` flags with NaN metrics, random baselines keyed
per sample, RISE's insertion blur, forward chunks on the CPU, and upsampling that keeps a constant map constant."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from scipy.ndimage import gaussian_filter
from torch import nn

from runner import chunks
from runner.metrics import curves as faithfulness
from runner.options.method.cam import BlurConfig, FaithfulnessConfig
from runner.schema import TargetMode
from runner.stats import upsample
from tests.conftest import TinyNet, frozen, make_config
from tests.test_cam_family import CPU, run_at


def test_pixel_rank_is_numpy_lexsort_of_saliency_then_key() -> None:
    g = torch.Generator().manual_seed(1)
    saliency = torch.randint(0, 4, (3, 400), generator=g).float() / 3  # (B, P): every value ~100 times
    keys = faithfulness.tie_keys(0, [4, 0, 7], 400, torch.device("cpu"))  # (B, P)
    rank = faithfulness.pixel_rank(saliency, keys)
    for b in range(3):
        order = np.lexsort((keys[b].numpy(), -saliency[b].numpy()))  # last key is primary
        expected = np.empty(400, dtype=np.int64)
        expected[order] = np.arange(400)
        np.testing.assert_array_equal(rank[b].numpy(), expected)
    # Position is not the tie-break: among the tied top pixels, the first deleted is not the first in memory.
    top = saliency[0] == saliency[0].max()
    assert rank[0][top].argmin() != 0


def test_tie_keys_depend_on_the_sample_not_its_batch() -> None:
    together = faithfulness.tie_keys(3, [10, 11, 12], 64, torch.device("cpu"))
    alone = faithfulness.tie_keys(3, [11], 64, torch.device("cpu"))
    torch.testing.assert_close(together[1], alone[0], rtol=0, atol=0)
    assert not torch.equal(together[0], together[1])  # each sample its own order
    assert not torch.equal(together[0], faithfulness.tie_keys(4, [10], 64, torch.device("cpu"))[0])  # the seed


class PositionNet(nn.Module):
    """logits = [sum of the input weighted by a fixed ramp over positions, 0]: the order of deletion matters."""

    def __init__(self, side: int) -> None:
        super().__init__()
        self.register_buffer("ramp", torch.linspace(-1, 1, side * side).reshape(1, 1, side, side))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = (x * self.ramp).sum(dim=(1, 2, 3))
        return torch.stack([total, torch.zeros_like(total)], dim=1)


def _tied_inputs(side: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.rand(4, 3, side, side, generator=g) + 0.5  # (B, C, H, W)
    saliency = (torch.rand(4, side, side, generator=g) * 3).floor() / 2  # values 0, 0.5, 1: ~21 pixels each
    return x, saliency


def _aucs(x: torch.Tensor, saliency: torch.Tensor, indices: list[int], cfg: FaithfulnessConfig) -> torch.Tensor:
    model = PositionNet(x.shape[-1])
    keys = faithfulness.tie_keys(cfg.seed, indices, x.shape[-2] * x.shape[-1], x.device)
    deletion, insertion = faithfulness.curve_aucs(model, x, saliency, torch.zeros(len(indices), dtype=torch.long),
                                                  keys, cfg, CPU)  # fmt: skip
    return torch.stack([deletion, insertion], dim=1)  # (B, 2)


def test_auc_with_ties_does_not_depend_on_batch_layout_or_chunk() -> None:
    x, saliency = _tied_inputs()
    cfg = FaithfulnessConfig(steps=8, chunk=5)
    full = _aucs(x, saliency, [0, 1, 2, 3], cfg)
    torch.testing.assert_close(_aucs(x, saliency, [0, 1, 2, 3], cfg), full, rtol=0, atol=0)  # twice
    perm = [2, 0, 3, 1]
    torch.testing.assert_close(_aucs(x[perm], saliency[perm], perm, cfg), full[perm], rtol=0, atol=1e-6)
    singles = torch.cat([_aucs(x[i : i + 1], saliency[i : i + 1], [i], FaithfulnessConfig(steps=8, chunk=1))
                         for i in range(4)])  # fmt: skip
    torch.testing.assert_close(singles, full, rtol=0, atol=1e-6)


def test_deletion_auc_follows_the_lexsort_order() -> None:
    """A plain loop over steps, pixels deleted in numpy lexsort order (saliency desc, then the seeded key)."""
    x, saliency = _tied_inputs()
    cfg = FaithfulnessConfig(steps=8, chunk=64)
    got = _aucs(x, saliency, [0, 1, 2, 3], cfg)[:, 0]
    model, pixels = PositionNet(8), 64
    keys = faithfulness.tie_keys(cfg.seed, [0, 1, 2, 3], pixels, torch.device("cpu")).numpy()
    for b in range(4):
        order = np.lexsort((keys[b], -saliency[b].flatten().numpy()))
        curve = []
        for k in range(cfg.steps + 1):
            image = x[b].clone().reshape(3, -1)
            image[:, order[: round(k / cfg.steps * pixels)]] = 0
            curve.append(float(model(image.reshape(1, 3, 8, 8)).softmax(1)[0, 0]))
        assert float(got[b]) == pytest.approx(np.trapezoid(curve, np.linspace(0, 1, cfg.steps + 1)), abs=1e-6)


# ---- degenerate maps and constant logits: flagged, NaN metrics; random baselines keyed per sample --------------------
class NegativeNet(nn.Module):
    """Class 0's logit is minus the sum of a positive feature map: Grad-CAM for class 0 is ReLU(negative) = 0."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 2, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = self.features(x).sum(dim=(1, 2, 3))
        return torch.stack([-total, total], dim=1)


def test_all_zero_map_is_flagged_degenerate_with_nan_metrics(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = frozen(NegativeNet())
    x = torch.randn(2, 3, 8, 8)
    faith = FaithfulnessConfig(enabled=True, steps=4)
    with caplog.at_level(logging.WARNING):
        columns = run_at(model, x, ["features.1"], name="gradcam", target=TargetMode.fixed, class_ids=[0],
                         faithfulness=faith)  # fmt: skip
    assert (columns["map"].values == 0).all()
    assert columns["degenerate"].all() and not columns["constant_logits"].any()
    values = columns["faithfulness"].values  # (rows, 8): own four, then random_*
    assert torch.isnan(values[:, :4]).all()  # not ordinary-looking numbers
    assert torch.isfinite(values[:, 4:]).all()  # the random baseline is still a measurement
    assert sum("degenerate" in r.message for r in caplog.records) == 1
    ok = run_at(model, x, ["features.1"], name="gradcam", target=TargetMode.fixed, class_ids=[1], faithfulness=faith)
    assert not ok["degenerate"].any() and torch.isfinite(ok["faithfulness"].values).all()


def test_constant_logits_are_flagged_and_all_metrics_nan(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    nn.init.zeros_(model.fc.weight)
    nn.init.zeros_(model.fc.bias)
    model = frozen(model)
    x = torch.randn(2, 3, 8, 8)
    with caplog.at_level(logging.WARNING):
        columns = run_at(
            model, x, ["features.2"], name="scorecam", faithfulness=FaithfulnessConfig(enabled=True, steps=4)
        )
    assert columns["constant_logits"].all()
    assert torch.isnan(columns["faithfulness"].values).all()  # the class explained is arbitrary: no number
    assert any("all logits are equal" in r.message for r in caplog.records)


def test_random_baseline_is_keyed_by_sample_not_batch() -> None:
    torch.manual_seed(0)
    model = frozen(TinyNet())
    x = torch.randn(4, 3, 8, 8)
    faith = FaithfulnessConfig(enabled=True, steps=4, seed=7)
    whole = run_at(model, x, ["features.0", "features.2"], name="gradcam", faithfulness=faith)
    tail = run_at(model, x[2:], ["features.0", "features.2"], first_index=2, name="gradcam", faithfulness=faith)
    random_cols = whole["faithfulness"].names.index("random_deletion_auc")
    w = whole["faithfulness"].values.reshape(2, 4, 8)[:, 2:, random_cols:]  # (layers, samples 2-3, random_*)
    t = tail["faithfulness"].values.reshape(2, 2, 8)[:, :, random_cols:]
    torch.testing.assert_close(t, w, rtol=0, atol=1e-6)  # not drawn from the batch's first index
    torch.testing.assert_close(tail["faithfulness"].values, whole["faithfulness"].values.reshape(2, 4, 8)[:, 2:]
                               .reshape(4, 8), rtol=0, atol=1e-6)  # fmt: skip


# ---- insertion blur (RISE's) and forward chunks ----------------------------------------------------------------------
def test_insertion_blur_default_is_rise() -> None:
    """RISE (eclique/RISE, `gkern(11, 5)`): a centred delta through scipy's gaussian_filter, conv2d, zero padding."""
    cfg = make_config().method.faithfulness.insertion_blur
    assert (cfg.kernel_size, cfg.sigma, cfg.padding.value) == (11, 5.0, "zero")
    delta = np.zeros((11, 11))
    delta[5, 5] = 1
    kernel = torch.from_numpy(gaussian_filter(delta, 5)).float()  # (11, 11)
    x = torch.rand(2, 3, 20, 20, generator=torch.Generator().manual_seed(0))
    expected = nn.functional.conv2d(x, kernel.expand(3, 1, 11, 11), padding=5, groups=3)
    torch.testing.assert_close(faithfulness.blurred(x, cfg), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(faithfulness.rise_kernel(11, 5.0).outer(faithfulness.rise_kernel(11, 5.0)), kernel)


def test_insertion_blur_is_configurable() -> None:
    cfg = make_config("method.faithfulness.insertion_blur.kernel_size=5", "method.faithfulness.insertion_blur.sigma=1",
                      "method.faithfulness.insertion_blur.padding=reflect").method.faithfulness.insertion_blur  # fmt: skip
    x = torch.ones(1, 3, 9, 9)
    torch.testing.assert_close(faithfulness.blurred(x, cfg), x)  # reflect keeps a constant image constant
    assert float(faithfulness.blurred(x, BlurConfig())[0, 0, 0, 0]) < 0.9  # zero padding darkens the border


@pytest.mark.slow
def test_perturbed_inputs_go_through_in_small_batches_on_cpu_unless_a_chunk_is_set() -> None:
    """On a CPU a batch of 64 images at 224 px ran 2.5x slower per image than one of 8 (benchmarks/RESULTS.md):
    with no chunk set, deletion/insertion and the evaluation metrics forward at most 8 such images at once."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device descriptor; no GPU needed
    assert chunks.forward_chunk(None, cpu, (224, 224)) == 8
    assert chunks.forward_chunk(None, cpu, (32, 32)) == 392  # small images: the same pixels per forward
    assert chunks.forward_chunk(None, cuda, (224, 224)) == 64
    assert chunks.forward_chunk(5, cpu, (224, 224)) == 5
    model = TinyNet().eval()
    sizes: list[int] = []
    model.register_forward_hook(lambda _m, inputs, _o: sizes.append(inputs[0].shape[0]))
    x = torch.rand(2, 3, 224, 224)
    saliency = [torch.rand(2, 224, 224)]
    with torch.no_grad():
        probs = model(x).softmax(1)
        target = probs.argmax(1)
        sizes.clear()
        no_flags = torch.zeros(2, dtype=torch.bool)
        for chunk, largest in ((None, 8), (5, 5)):
            faithfulness.evaluate(model, x, saliency, saliency, target, probs, FaithfulnessConfig(steps=8, chunk=chunk),
                                  CPU, range(2), [no_flags], no_flags)  # fmt: skip
            assert max(sizes) == largest
            sizes.clear()


# ---- constant maps stay constant: upsampling cannot invent an order --------------------------------------------------
def test_upsample_keeps_a_constant_map_constant_at_zero() -> None:
    """Bilinear float32 weights leave 1-ulp ripples on a constant map; min-max scaling stretched them to a full-range
    map (min 0, max 1, mean 0.49). A map constant at its own resolution is all 0 at the input's size."""
    maps = torch.cat([torch.full((1, 1, 1), 0.37).expand(1, 3, 3), torch.rand(1, 3, 3)])  # (2, 3, 3)
    up = upsample(maps, (32, 32))
    assert (up[0] == 0).all()
    assert up[1].min() == 0 and up[1].max() == 1  # an ordinary map is scaled as before
    assert (upsample(torch.full((1, 1, 1), 0.37), (32, 32)) == 0).all()  # a 1x1 layer's map
    assert torch.isnan(upsample(torch.tensor([[[float("nan"), 1.0]]]), (4, 4))).all()  # stays NaN


def test_the_mib_table_takes_cpr_from_the_signed_ranking_and_cmd_from_the_absolute() -> None:
    """As MIB's print_results.py: per split, CPR of the signed ranking's curve, CMD of the absolute one's; rows of
    one ranking only are refused with a message naming the command that runs both."""
    import pandas as pd

    from runner.errors import RunnerError
    from runner.methods.lm_edges import mib_scores

    rows = pd.DataFrame({
        "scored_by": ["eap_clean"] * 4, "ablation": ["corrupted"] * 4, "metric": ["token_logit_diff"] * 4,
        "split": ["discovery", "held_out", "discovery", "held_out"],
        "ranking": ["signed", "signed", "absolute", "absolute"],
        "cpr": [1.2, 1.1, 0.7, 0.6], "cmd": [0.30, 0.35, 0.03, 0.05],
    })  # fmt: skip
    table = mib_scores(rows).set_index("split")
    assert table.loc["discovery", "cpr"] == 1.2 and table.loc["held_out", "cpr"] == 1.1
    assert table.loc["discovery", "cmd"] == 0.03 and table.loc["held_out", "cmd"] == 0.05
    with pytest.raises(RunnerError, match="both rankings.*method.edges.ranking=both"):
        mib_scores(rows[rows.ranking == "absolute"])
