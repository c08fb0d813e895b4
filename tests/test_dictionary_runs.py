"""Sparse dictionaries through the CLI (model.dictionaries): every LM method reads the sites `latent` and `error`, and
what it reports equals a reference written here on the unspliced model with plain torch hooks; a dictionary that
does not fit the model is refused in one line before the model loads. A random two-layer Llama (grouped-query),
an SAE at resid_post of layer 1 and a transcoder at layer 0's MLP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import runner.app as app
from runner.dictionaries.dictionary import Dictionary, DictionarySpec
from runner.dictionaries.formats import load_dictionary, save_saelens
from runner.results import load, load_activations
from tests.conftest import make_config, run_cli
from tests.test_dictionary_splice import random_dictionary
from tests.test_lm_cache import alone, saved_lm
from tests.test_lm_saliency import SAME_LENGTH

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spliced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model, its tokenizer, the run's overrides with both dictionaries, and the dictionaries as loaded."""
    folder = tmp_path_factory.mktemp("dictionaries")
    model, tokenizer, run = saved_lm("llama", folder)
    pairs = folder / "same_length.jsonl"
    pairs.write_text("\n".join(json.dumps(p) for p in SAME_LENGTH))
    run = [*[o for o in run if not o.startswith("data.file=")], f"data.file={pairs}"]
    d = model.config.hidden_size
    sae = random_dictionary(d, "topk", seed=3, width=256)  # k = 6 of 256: most latents are 0 in both runs
    transcoder = random_dictionary(d, "jumprelu", seed=4, transcoder=True)
    transcoder = _without_input_bias(transcoder)
    save_saelens(sae, folder / "sae", "blocks.1.hook_resid_post", "tiny-llama")
    save_saelens(transcoder, folder / "transcoder", "blocks.0.ln2.hook_normalized", "tiny-llama")
    placed = (f"model.dictionaries=[{{path: {folder / 'sae'}, site: resid_post, layer: 1}},"
              f" {{path: {folder / 'transcoder'}, site: mlp, layer: 0}}]")  # fmt: skip
    return {"model": model, "tokenizer": tokenizer, "run": [*run, placed], "folder": folder,
            "sae": load_dictionary(folder / "sae"), "transcoder": load_dictionary(folder / "transcoder")}  # fmt: skip


def _without_input_bias(dictionary: Dictionary) -> Dictionary:
    """A SAELens transcoder does not subtract b_dec from its input."""
    spec = DictionarySpec(**{**dictionary.spec.__dict__, "apply_b_dec_to_input": False})
    plain = Dictionary(spec)
    plain.load_state_dict(dictionary.state_dict())
    return plain.requires_grad_(False)


def _site_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Plain hooks: layer 1's output (what the SAE reads) and layer 0's MLP input and output (the transcoder's)."""
    seen: dict[str, torch.Tensor] = {}
    block0, block1 = model.model.layers[0], model.model.layers[1]
    handles = [
        block1.register_forward_hook(lambda m, a, o: seen.update(resid=o[0] if isinstance(o, tuple) else o)),
        block0.mlp.register_forward_hook(lambda m, a, o: seen.update(mlp_in=a[0], mlp_out=o)),
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def _logit_diff(model: torch.nn.Module, ids: torch.Tensor, pair: dict[str, str], tokenizer: Any,
                add: dict[str, torch.Tensor] | None = None) -> float:  # fmt: skip
    """The answer's minus the distractor's logit at the last position, with `add` (layer 0's MLP output, layer 1's
    output) added by plain hooks."""
    add = add or {}
    handles = []
    if "mlp" in add:
        handles.append(model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: o + add["mlp"]))
    if "resid" in add:
        handles.append(model.model.layers[1].register_forward_hook(
            lambda m, a, o: (o[0] + add["resid"], *o[1:]) if isinstance(o, tuple) else o + add["resid"]))  # fmt: skip
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    answer, distractor = (tokenizer.convert_tokens_to_ids(pair[k]) for k in ("answer", "distractor"))
    return float(logits[answer] - logits[distractor])


def test_exact_patching_of_each_latent_and_error_equals_a_plain_hooks_loop(spliced: dict, tmp_path: Path) -> None:
    """Denoising: each latent's clean value put into the corrupted run moves the stream by (clean - corrupted) x its
    decoder row at every position; the error's clean value, by (clean - corrupted) error."""
    app.run(make_config(*spliced["run"], "method=lm_patching", "method.patching.sites=[latent,error]"), tmp_path)
    frame = load(tmp_path, "lm_patching")
    model, tokenizer = spliced["model"], spliced["tokenizer"]
    checked = 0
    every: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {
        "resid": [],
        "mlp": [],
    }  # each pair's (clean, corrupted) f
    for pair in SAME_LENGTH:
        sites = [_site_inputs(model, alone(tokenizer, {"clean": pair[key]})) for key in ("clean", "corrupted")]
        every["resid"].append(tuple(spliced["sae"].encode(x["resid"]) for x in sites))  # type: ignore[arg-type]
        every["mlp"].append(tuple(spliced["transcoder"].encode(x["mlp_in"]) for x in sites))  # type: ignore[arg-type]
    for sample, pair in enumerate(SAME_LENGTH):
        clean_ids = alone(tokenizer, pair)
        corrupted_ids = alone(tokenizer, {"clean": pair["corrupted"]})
        clean, corrupted = _site_inputs(model, clean_ids), _site_inputs(model, corrupted_ids)
        f = {
            "resid": (spliced["sae"].encode(clean["resid"]), spliced["sae"].encode(corrupted["resid"])),
            "mlp": (spliced["transcoder"].encode(clean["mlp_in"]), spliced["transcoder"].encode(corrupted["mlp_in"])),
        }
        rows = frame[frame["sample"] == sample]
        for part, layer, dictionary in (("resid", 1, spliced["sae"]), ("mlp", 0, spliced["transcoder"])):
            latents = rows[(rows.site == "latent") & (rows.layer == layer)]
            f_clean, f_corrupted = f[part]
            # a row for each latent that differs between the runs of some pair, none for the others (no effect)
            changed = {
                i for i in range(dictionary.width)
                if any((spliced_f[0][0, :, i] != spliced_f[1][0, :, i]).any() for spliced_f in every[part])
            }  # fmt: skip
            assert set(latents["head"].astype(int)) == changed and len(changed) > 0
            assert part == "mlp" or len(changed) < dictionary.width / 2  # the TopK SAE's rows: far from every latent
            for _, row in latents.iterrows():
                i = int(row["head"])
                change = (f_clean[0, :, i] - f_corrupted[0, :, i])[:, None] * dictionary.W_dec[i]  # (T, d)
                if not change.abs().any():
                    assert row["patched"] == row["corrupted"]  # unchanged in this pair: the receiving run's metric
                    continue
                expected = _logit_diff(model, corrupted_ids, pair, tokenizer, {part: change[None]})
                assert row["patched"] == pytest.approx(expected, abs=1e-4 * max(1.0, abs(expected)))
                checked += 1
            error = rows[(rows.site == "error") & (rows.layer == layer)].sort_values("position")
            for _, row in error.iterrows():
                p = int(row["position"])
                if part == "resid":
                    e = [x["resid"] - spliced["sae"].decode(spliced["sae"].encode(x["resid"]), x["resid"])
                         for x in (clean, corrupted)]  # fmt: skip
                else:
                    e = [x["mlp_out"] - dictionary.decode(dictionary.encode(x["mlp_in"]), x["mlp_in"])
                         for x in (clean, corrupted)]  # fmt: skip
                change = torch.zeros_like(e[0])
                change[:, p] = e[0][:, p] - e[1][:, p]
                expected = _logit_diff(model, corrupted_ids, pair, tokenizer, {part: change})
                assert row["patched"] == pytest.approx(expected, abs=1e-4 * max(1.0, abs(expected)))
                checked += 1
    assert checked > 20


def test_the_cache_keeps_each_dictionarys_latents_and_error(spliced: dict, tmp_path: Path) -> None:
    app.run(make_config(*spliced["run"], "method=lm_cache", "method.sites=[latent,error]"), tmp_path)
    cache = load_activations(tmp_path)
    model, tokenizer = spliced["model"], spliced["tokenizer"]
    ids = alone(tokenizer, SAME_LENGTH[0])
    seen = _site_inputs(model, ids)
    sae = spliced["sae"]
    latents = cache.get("latent", 1)[0]  # (T, width, 1)
    assert torch.allclose(latents[..., 0], sae.encode(seen["resid"])[0], atol=1e-5)
    error = cache.get("error", 1)[0]
    assert torch.allclose(error, (seen["resid"] - sae(seen["resid"]))[0], atol=1e-5)


def test_grad_x_act_of_latents_and_error_equals_plain_autograd(spliced: dict, tmp_path: Path) -> None:
    """A latent's gradient x activation is f_i x (W_dec[i] . g), the error's e . g, g the target's gradient at the
    site the dictionary writes (here the transcoder's: layer 0's MLP output), taken on the unspliced model."""
    app.run(make_config(*spliced["run"], "method=lm_grad_x_act", "method.sites=[latent,error]", "method.layers=[0]"),
            tmp_path)  # fmt: skip
    frame = load(tmp_path, "lm_grad_x_act")
    model, tokenizer, transcoder = spliced["model"], spliced["tokenizer"], spliced["transcoder"]
    pair = SAME_LENGTH[0]
    ids = alone(tokenizer, pair)
    seen: dict[str, torch.Tensor] = {}

    def keep(m: torch.nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor:
        seen["x"], seen["y"] = a[0].detach(), o
        return o

    handle = model.model.layers[0].mlp.register_forward_hook(keep)
    try:
        with torch.enable_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, -1]
            answer, distractor = (tokenizer.convert_tokens_to_ids(pair[k]) for k in ("answer", "distractor"))
            (g,) = torch.autograd.grad(logits[answer] - logits[distractor], seen["y"])
    finally:
        handle.remove()
    g = g[0]  # (T, d)
    f = transcoder.encode(seen["x"])[0]  # (T, width)
    error = (seen["y"].detach() - transcoder(seen["x"]))[0]  # (T, d)
    rows = frame[frame["sample"] == 0]
    latents = rows[rows.site == "latent"]
    expected = f * (g @ transcoder.W_dec.T)  # (T, width)
    got = torch.tensor(latents.sort_values(["position", "head"])["value"].to_numpy()).view_as(expected)
    scale = expected.abs().max()
    assert scale > 1e-3 and (got - expected).abs().max() <= 1e-4 * scale
    got_error = torch.tensor(rows[rows.site == "error"].sort_values("position")["value"].to_numpy())
    assert (got_error - (error * g).sum(-1)).abs().max() <= 1e-4 * (error * g).sum(-1).abs().max()


def _bad_folders(folder: Path, d: int) -> dict[str, Path]:
    """Dictionaries that must be refused: too narrow for the model, NaN weights, a pickle beside the weights."""
    narrow, nan, code = folder / "narrow", folder / "nan", folder / "code"
    save_saelens(random_dictionary(d // 2, "relu"), narrow, "blocks.1.hook_resid_post", "tiny-llama")
    broken = random_dictionary(d, "relu")
    with torch.no_grad():
        broken.W_dec[3, 1] = float("nan")
    save_saelens(broken, nan, "blocks.1.hook_resid_post", "tiny-llama")
    save_saelens(random_dictionary(d, "relu"), code, "blocks.1.hook_resid_post", "tiny-llama")
    (code / "sae.pt").write_bytes(b"\x80\x04")
    return {"narrow": narrow, "nan": nan, "code": code}


@pytest.mark.parametrize(
    ("placed", "layers", "message", "before_load"),
    [
        ("{path: SAE, site: resid_post, layer: 1}", "[0]", "Site latent.0 is a spliced dictionary's", True),
        ("{path: NARROW, site: resid_post, layer: 1}", "[1]", "the model's", True),
        ("{path: SAE, site: mlp, layer: 1}", "[1]", "a transcoder goes at site=mlp", True),
        ("{path: SAE, site: resid_post, layer: 7}", "[1]", "the model has layers 0..1", True),
        ("{path: SAE, site: resid, layer: 1}", "[1]", "use one of resid_pre, resid_post", True),
        ("{path: CODE, site: resid_post, layer: 1}", "[1]", "sae.pt", True),
        ("{path: NAN, site: resid_post, layer: 1}", "[1]", "W_dec", False),
    ],
)
def test_a_dictionary_that_does_not_fit_is_refused_in_one_line(
    spliced: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, placed: str, layers: str, message: str,
    before_load: bool,
) -> None:  # fmt: skip
    d = spliced["model"].config.hidden_size
    folders = {"SAE": spliced["folder"] / "sae", **{k.upper(): v for k, v in _bad_folders(tmp_path, d).items()}}
    for name, path in folders.items():
        placed = placed.replace(f"path: {name},", f"path: {path},")
    if before_load:
        monkeypatch.setattr(app, "build_model", lambda cfg: pytest.fail("the model was built"))
    run = [o for o in spliced["run"] if not o.startswith("model.dictionaries")]
    done = run_cli(*run, f"model.dictionaries=[{placed}]", "method=lm_patching", "method.patching.sites=[latent]",
                   f"method.patching.layers={layers}", f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert done.returncode == 2, done.stderr
    # the model's own loading bar (the NaN dictionary is found once its weights load) is not a message of ours
    errors = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert not list((tmp_path / "run").rglob("*.parquet"))


def test_dla_splits_each_dictionarys_site_into_its_active_latents_error_and_bias(spliced: dict, tmp_path: Path) -> None:
    """The transcoder's latents + error + decoder bias add up to its MLP's row (m0); the SAE's at the last layer's
    resid_post to that stream's accumulated row; each latent row is an active latent (f != 0) of the cell."""
    app.run(make_config(*spliced["run"], "method=lm_dla", "method.positions=all"), tmp_path)
    frame = load(tmp_path, "lm_dla")
    keys = ["sample", "position"]
    split = frame[frame.kind.isin(["latent", "latent_error", "latent_bias"])]
    for layer, whole in ((0, frame[frame.writer == "m0"]), (1, frame[frame.writer == "resid_post.1"])):
        parts = split[split.layer == layer].groupby(keys)["value"].sum()
        whole = whole.set_index(keys)["value"]
        assert len(whole) > 5 and whole.abs().max() > 1e-3
        assert ((parts - whole).abs() <= 1e-4 * whole.abs().max()).all(), layer
    # the rows are the active latents: the transcoder's on pair 0's clean prompt, position by position
    model, tokenizer, transcoder = spliced["model"], spliced["tokenizer"], spliced["transcoder"]
    seen = _site_inputs(model, alone(tokenizer, SAME_LENGTH[0]))
    active = transcoder.encode(seen["mlp_in"])[0] != 0  # (T, width)
    rows = split[(split["sample"] == 0) & (split.kind == "latent") & (split.layer == 0)]
    assert len(rows) == int(active.sum()) > 0
    assert all(active[int(r.position), int(r["head"])] for _, r in rows.iterrows())
    # totals leave the re-split rows out: every row of a cell has the cell's writers' sum
    assert (frame.groupby(keys)["total"].nunique() == 1).all()


def test_runner_layers_lists_the_latents_and_error_where_a_dictionary_is(spliced: dict) -> None:
    run = [o for o in spliced["run"] if not o.startswith("hydra.")]
    done = run_cli("layers", *run, "method=lm_patching", "method.patching.sites=[latent]", "method.patching.layers=[1]")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if ".dictionary." in line]
    width = spliced["sae"].width
    assert any("latent.1" in line and f"[1, 4, {width}, 1]" in line and " * " in line for line in lines)
    assert any("error.1" in line for line in lines) and any("latent.0" in line for line in lines)
    assert sum("latent." in line for line in done.stdout.splitlines()) == 2  # one per dictionary, none elsewhere


def test_attribution_patching_of_latents_and_error_adds_up_to_the_sites(spliced: dict, tmp_path: Path) -> None:
    """First order, the decoder is linear: the latents' estimates (each at every position) plus the error's (per
    position) equal the stream's estimates summed over positions, pair by pair; the latents without rows (unchanged in
    every pair) add nothing."""
    app.run(make_config(*spliced["run"], "method=lm_patching", "method.patching.mode=attribution",
                        "method.patching.sites=[latent,error,resid_post]", "method.patching.layers=[1]"),
            tmp_path)  # fmt: skip
    frame = load(tmp_path, "lm_patching").assign(effect=lambda f: f["patched"] - f["corrupted"])
    parts = frame[frame.site.isin(["latent", "error"])].groupby("sample")["effect"].sum()
    whole = frame[frame.site == "resid_post"].groupby("sample")["effect"].sum()
    assert (frame.patch_method == "attribution").all() and whole.abs().min() > 1e-3
    assert ((parts - whole).abs() <= 1e-4 * whole.abs().max()).all()


def test_edges_of_the_spliced_model_are_the_models(spliced: dict, tmp_path: Path) -> None:
    """lm_edges reads the model's own components: with the dictionaries spliced in (their error terms exact), every
    edge's score is the unspliced model's to float rounding."""
    plain = [o for o in spliced["run"] if not o.startswith("model.dictionaries")]
    settings = ["method=lm_edges", "method.edges.mode=eap", "method.edges.resamples=0"]
    app.run(make_config(*spliced["run"], *settings), tmp_path / "spliced")
    app.run(make_config(*plain, *settings), tmp_path / "plain")
    with_dictionaries, without = (
        load(tmp_path / n, "lm_edges").set_index("edge")["score"] for n in ("spliced", "plain")
    )
    assert len(without) > 50 and set(with_dictionaries.index) == set(without.index)
    assert (with_dictionaries - without).abs().max() <= 1e-5 * without.abs().max()
