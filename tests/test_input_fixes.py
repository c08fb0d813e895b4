"""Inputs (issue 10, items 8, 14, 4, 16, 17): whole photos kept (resize=none/pad), 16-bit images scaled,
add_noise hook noise keyed per sample, and bad inputs that end in one clear message (exit 2)."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from torch import nn

from runner import app
from runner.data.base import build_dataset, make_loader
from runner.data.images import pil_to_rgb
from runner.errors import RunnerError
from runner.hooks import BoundHook, HookSession
from runner.layers import resolve_layers
from runner.schema import HookAction, HookKind, HookSpec
from tests.conftest import frozen, make_config, run_cli
from tests.test_cli import SMALL_VGG, assert_one_clear_error

# ---- item 8: resize=none keeps the aspect ratio, resize=pad letterboxes --------------------------------------


def _composite(path: Path, width: int = 448, height: int = 224) -> None:
    """A two-colour photo: red left half, blue right half (a cat left, an espresso right, in miniature)."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, : width // 2, 0] = 255
    pixels[:, width // 2 :, 2] = 255
    Image.fromarray(pixels).save(path)


def _folder(tmp_path: Path, resize: str, size: int = 64):
    _composite(tmp_path / "wide.png")
    _composite(tmp_path / "square.png", 224, 224)
    config = make_config(
        "data=image_folder", f"data.root={tmp_path}", f"data.image_size={size}", f"data.resize={resize}"
    )
    return config.data, build_dataset(config.data, None, 0)


def test_resize_none_keeps_the_aspect_ratio_and_pads_the_batch(tmp_path: Path) -> None:
    data, dataset = _folder(tmp_path, "none")
    ids = [dataset[i][2] for i in range(len(dataset))]
    wide = dataset[ids.index("wide.png")][0]
    assert tuple(wide.shape) == (3, 64, 128)  # 448x224 -> short side 64, long side 128: nothing cut or squashed
    # Both halves are there: red on the left half, blue on the right half (in normalised units, red > 0 on the left).
    assert float(wide[0, :, :60].mean()) > 1.5 and float(wide[2, :, 68:].mean()) > 1.5
    x, _, batch_ids = next(iter(make_loader(dataset, data, torch.device("cpu"))))
    assert tuple(x.shape) == (2, 3, 64, 128)  # a batch is padded to its largest image
    square = x[batch_ids.index("square.png")]  # (3, 64, 128)
    assert torch.equal(square[:, :, 64:], torch.zeros(3, 64, 64))  # padded at the right with 0 (the mean colour)
    assert float(square[:, :, :64].abs().mean()) > 0.5


def test_resize_pad_letterboxes(tmp_path: Path) -> None:
    _, dataset = _folder(tmp_path, "pad")
    ids = [dataset[i][2] for i in range(len(dataset))]
    wide = dataset[ids.index("wide.png")][0]
    assert tuple(wide.shape) == (3, 64, 64)
    assert torch.equal(wide[:, :16], torch.zeros(3, 16, 64)) and torch.equal(wide[:, 48:], torch.zeros(3, 16, 64))
    content = wide[:, 16:48]  # (3, 32, 64): the whole photo at half size, aspect kept
    assert float(content[0, :, :30].mean()) > 1.5 and float(content[2, :, 34:].mean()) > 1.5


def test_crop_loses_the_ends_and_the_log_says_how_images_were_resized(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="runner.data.base"):
        _, dataset = _folder(tmp_path, "crop")
    assert "centre crop 64x64" in caplog.text and "cut off" in caplog.text
    ids = [dataset[i][2] for i in range(len(dataset))]
    wide = dataset[ids.index("wide.png")][0]
    assert tuple(wide.shape) == (3, 64, 64)
    with caplog.at_level(logging.INFO, logger="runner.data.base"):
        _folder(tmp_path, "pad")
    assert "letterboxed to 64x64" in caplog.text


def test_image_folder_default_keeps_the_whole_photo() -> None:
    assert make_config("data=image_folder", "data.root=/x").data.resize.value == "pad"


# ---- item 14: 16-bit images are scaled, not clipped --------------------------------------------------------------


def test_16_bit_png_matches_its_8_bit_copy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    eight = rng.integers(0, 256, (40, 48), dtype=np.uint8)
    Image.fromarray(eight).save(tmp_path / "a8.png")
    Image.fromarray(eight.astype(np.uint16) * 257).save(tmp_path / "b16.png")  # the same picture in 16 bits
    with Image.open(tmp_path / "b16.png") as im:
        assert im.mode.startswith("I")  # PIL opens it as a 16-bit grey image
        rgb = np.asarray(pil_to_rgb(im))
    assert np.array_equal(rgb[..., 0], eight)
    config = make_config("data=image_folder", f"data.root={tmp_path}", "data.image_size=32", "data.resize=square")
    dataset = build_dataset(config.data, None, 0)
    tensors = {dataset[i][2]: dataset[i][0] for i in range(2)}
    # Means in 0-1 pixel units (undoing the normalisation's std) agree within 1/255.
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    gap = ((tensors["b16.png"] - tensors["a8.png"]) * std).mean(dim=(1, 2)).abs().max()
    assert float(gap) <= 1 / 255


def test_16_bit_dark_image_is_not_taken_for_8_bit() -> None:
    dark = np.full((4, 4), 200, dtype=np.uint16)  # 200 of 65535: nearly black, not 200 of 255
    with Image.fromarray(dark) as im:
        assert int(np.asarray(pil_to_rgb(im)).max()) == 1


# ---- item 4 (hooks): add_noise keyed per sample ------------------------------------------------------------------


def test_add_noise_is_the_same_per_sample_at_batch_sizes_1_3_4() -> None:
    model = frozen(nn.Sequential(nn.Identity()))
    x = torch.zeros(12, 5)  # 12 samples; the output is exactly the noise
    spec = HookSpec(kind=HookKind.forward, action=HookAction.add_noise, std=1.0, seed=3)
    by_size = {}
    for size in (1, 3, 4):
        outs = []
        with HookSession(model, [BoundHook(spec, resolve_layers(model, ["0"]))]) as session:
            for first in range(0, 12, size):
                session.begin_batch(size, first)
                outs.append(model(x[first : first + size]))
        by_size[size] = torch.cat(outs)  # (12, 5)
    torch.testing.assert_close(by_size[1], by_size[3], rtol=0, atol=0)
    torch.testing.assert_close(by_size[1], by_size[4], rtol=0, atol=0)
    assert len({tuple(r.tolist()) for r in by_size[1]}) == 12  # each sample has its own noise
    # A resumed run starts at a later batch with a fresh session: sample 8 gets the same noise.
    with HookSession(model, [BoundHook(spec, resolve_layers(model, ["0"]))]) as session:
        session.begin_batch(4, 8)
        torch.testing.assert_close(model(x[8:12]), by_size[1][8:12], rtol=0, atol=0)


def test_add_noise_rows_do_not_depend_on_batch_size_in_a_run(tmp_path: Path) -> None:
    tiny = [
        "model._target_=tests.conftest.TinyNet", "model.weights=null", "data=synthetic", "data.shape=[3,5,5]",
        "data.count=6", "data.num_classes=5", "method=record", "output.shard_batches=1", "layers.include=[features.0]",
        "hooks=[{kind: forward, action: add_noise, std: 0.5, layers: [features.0]}, {kind: forward, layers: [features.0]}]",
    ]  # fmt: skip
    tables = {}
    for size in (1, 4):
        result = app.run(make_config(*tiny, f"data.batch_size={size}"), tmp_path / str(size))
        frame = pd.read_parquet(result.tables["hooks"]).sort_values(["sample", "role"])
        tables[size] = frame[["sample", "mean", "std", "min", "max"]].reset_index(drop=True)
    # (5x5 inputs: 150 values a sample, a size at which torch's old one-generator draws differed by batch size)
    pd.testing.assert_frame_equal(tables[1], tables[4])


# ---- items 16 and 17: one clear message, exit 2 ------------------------------------------------------------------


def assert_one_line(done: subprocess.CompletedProcess, out: Path, message: str) -> None:
    assert_one_clear_error(done, out, message)
    errors = [line for line in done.stderr.splitlines() if line.startswith("[ERROR]")]
    assert len(errors) == 1 and message in errors[0], done.stderr


SYNTHETIC = ["data=synthetic", "data.count=2", "data.batch_size=1"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["device=meta"], "device=meta: use auto, cpu"),
        ([*SYNTHETIC, "data.shape=[3,32]"], "one sample of an image model is [channels, height, width]"),
        (["data.image_size=16"], "too small for the model's downsampling"),
        ([*SYNTHETIC, "data.shape=[3,60000,60000]"], "43.2 GB per sample"),
        (["hooks=[{kind: forward, action: clamp, min: 1, max: 0}]"], "min=1.0 is above max=0.0"),
        (["hooks=[{kind: forward, action: add_noise, std: -1}]"], "std=-1.0"),
        (["method.faithfulness.enabled=true", "method.faithfulness.steps=1000000"], "above the bound of 1000"),
        (["data.photos=[]"], "data.photos is empty"),
        (["data.photos=[chelseaa]"], "Photos shipped with scikit-image: astronaut"),
        (["layers.exclude=[features.*]"], "Narrow layers.exclude"),
        (
            [
                "model=resnet18",
                "model.weights=null",
                "layers.include=[layer4]",
                "hooks=[{kind: backward, layers: [layer1.0.bn2]}]",
            ],
            "A `backward` hook on 'layer1.0.bn2' (BatchNorm2d) cannot run",
        ),  # fmt: skip
    ],
)
def test_bad_inputs_give_one_clear_message(tmp_path: Path, overrides: list[str], message: str) -> None:
    assert_one_line(run_cli(*SMALL_VGG, *overrides, f"hydra.run.dir={tmp_path}"), tmp_path, message)


def test_every_image_unreadable_says_which_and_how_to_fix(tmp_path: Path) -> None:
    for name in ("a.png", "b.jpg"):
        (tmp_path / name).write_bytes(b"not an image")
    with pytest.raises(RunnerError, match=r"Every image in .* \(2 file\(s\): a.png, b.jpg\).*point data.root"):
        build_dataset(make_config("data=image_folder", f"data.root={tmp_path}").data, None, 0)


def test_probe_rejects_an_input_the_model_cannot_take(tmp_path: Path) -> None:
    config = make_config(*SMALL_VGG, "data.image_size=16")
    with pytest.raises(RunnerError, match="too small for the model's downsampling"):
        app.run(config, tmp_path)
    assert not list(tmp_path.rglob("*.parquet*"))


@pytest.mark.slow
def test_sweep_that_stops_at_a_bad_job_names_the_jobs_not_run(tmp_path: Path) -> None:
    done = run_cli(
        "-m", *SMALL_VGG, "data.photos=[chelsea]", "method.target=fixed,predicted,label", f"hydra.sweep.dir={tmp_path}"
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("[ERROR]")]
    assert len(errors) == 1
    assert "job #0 (method.target=fixed) failed" in errors[0]
    assert "2 job(s) not run: #1 (method.target=predicted), #2 (method.target=label)" in errors[0]
    assert f"hydra.sweep.dir={tmp_path}" in errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["a: b: c", "@v2", "*best"])
def test_override_values_that_are_not_plain_yaml_run(tmp_path: Path, name: str) -> None:
    done = run_cli(*SMALL_VGG, "data.photos=[chelsea]", "layers.include=[features.28]", f"name={name}",
               f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert set(pd.read_parquet(tmp_path / "cam.parquet")["sweep.name"]) == {name}
