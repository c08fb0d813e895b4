"""The activation cache (method=lm_cache, runner/methods/lm_cache.py) and its reader (runner/store/activations.py):
what it holds is the model's own hidden states and the patching engine's captures on each pair alone, whatever the
batch; its bad settings are refused before the model loads; and its index never names a file that is not whole,
also after a failed write, a run stopped between a file and its shard's commit, and a resume. Random-weight GPT-2
and grouped-query Llama models (tests/lm_references.py), pairs of two lengths so that every batch is left-padded."""

from __future__ import annotations

import errno
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import runner.app as app
from runner.errors import RunnerError
from runner.hooks import HookSession
from runner.hooks.sites import SiteHooks
from runner.methods.lm.base import forward_last
from runner.models.lm_sites import layout_of
from runner.options.method.lm_cache import LmCacheConfig
from runner.results import load, load_activations
from runner.site_kinds import SITE_KINDS
from runner.store.activations import ActivationCache
from runner.store.writer import ShardedWriter
from tests.conftest import make_config, run_cli
from tests.lm_references import build_tiny_lm
from tests.test_lm_saliency import PAIRS  # 8, 6 and 8 tokens with the BOS: one batch is left-padded

EVERY_SITE = list(SITE_KINDS)
TOL = {"atol": 1e-5, "rtol": 1e-5}  # a left-padded batch against one prompt alone: float32 rounding only
ON_CPU = ["device=cpu"]  # where the references run: the same kernels, so 1e-5 holds on a GPU machine too


def saved_lm(arch: str, folder: Path) -> tuple[Any, Any, list[str]]:
    """(model, tokenizer, the overrides of a run of it on PAIRS): a random model of `arch` saved in `folder`."""
    model, tokenizer, saved = build_tiny_lm(arch, seed=0, folder=folder / "model")
    pairs = folder / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(p) for p in PAIRS))
    return model, tokenizer, [*ON_CPU, "model=hf_lm", f"model.name={saved}", "data=prompts", f"data.file={pairs}"]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, list[str]]:
    return saved_lm(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, list[str]]:
    """The grouped-query Llama alone (4 query heads, 2 key-value heads)."""
    found = saved_lm("llama", tmp_path_factory.mktemp("gqa"))
    assert found[0].config.num_key_value_heads < found[0].config.num_attention_heads
    return found


def cached(out: Path, run: list[str], *overrides: str) -> ActivationCache:
    app.run(make_config(*run, "method=lm_cache", *overrides), out)
    return load_activations(out)


def alone(tokenizer: Any, pair: dict[str, str]) -> torch.Tensor:
    """(1, T) the pair's clean prompt as a run tokenises it (BOS first), unpadded."""
    return torch.tensor([[tokenizer.bos_token_id, *tokenizer(pair["clean"], add_special_tokens=False)["input_ids"]]])


def final_norm(model: Any) -> torch.nn.Module:
    return model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm


# ---- what the cache holds ------------------------------------------------------------------------------------------
def test_the_cache_is_the_models_own_hidden_states_without_the_padding(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """resid_pre of block l is hidden_states[l] of each pair run alone, resid_post hidden_states[l + 1]; the last
    entry is after the final norm, so the last block's resid_post is compared through that norm. One batch of pairs of
    two lengths: the shorter pair's padding must be cut from the left, its positions counted from its first token."""
    model, tokenizer, run = tiny
    cache = cached(tmp_path, run, "method.sites=[resid_pre,resid_post]", "data.batch_size=3")
    layers = model.config.num_hidden_layers
    assert cache.sites == ["resid_pre", "resid_post"] and cache.layers == list(range(layers))
    assert len(cache) == 3 and cache.sample_ids == ["pair-0", "pair-1", "pair-2"]
    assert cache.lengths.tolist() == cache.prompt_lengths.tolist() == [8, 6, 8]
    for i, pair in enumerate(PAIRS):
        ids = alone(tokenizer, pair)
        assert cache.tokens(i) == tokenizer.convert_ids_to_tokens(ids[0])
        with torch.no_grad():
            hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            for layer in range(layers):
                torch.testing.assert_close(cache.get("resid_pre", layer)[i], hidden[layer][0], **TOL)
                post = cache.get("resid_post", layer)[i]
                if layer == layers - 1:  # hidden_states' last entry is the last block's output after the final norm
                    post = final_norm(model)(post)
                torch.testing.assert_close(post, hidden[layer + 1][0], **TOL)
    padded = cache["resid_pre", 1]  # (N, T_max, d): right-padded with zeros where the mask is False
    assert padded.shape == (3, 8, model.config.hidden_size) and padded.dtype == torch.float32
    assert cache.mask.tolist()[1] == [True] * 6 + [False] * 2
    assert torch.equal(padded[1, :6], cache.get("resid_pre", 1)[1]) and not padded[1, 6:].any()
    assert torch.equal(cache["resid_pre.1"], padded) and ("resid_post", 0) in cache and ("attn_out", 0) not in cache
    with pytest.raises(KeyError, match=r"no \('attn_out', 0\) in this cache: sites \['resid_pre', 'resid_post'\]"):
        cache["attn_out", 0]


def test_every_site_is_what_the_patching_engine_keeps_on_each_pair_alone(llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Every site the grouped-query Llama has, the per-head ones (q with its 4 heads, k and v with their 2 key-value
    heads, the pattern with its padded keys cut too) included, equals `SiteHooks.keep()` on the pair's prompt run
    alone (no padding at all)."""
    model, tokenizer, run = llama
    cache = cached(tmp_path, run, f"method.sites=[{','.join(EVERY_SITE)}]", "data.batch_size=3")
    layout = layout_of(model)
    specs = [layout.site(kind, layer) for kind in EVERY_SITE for layer in range(layout.layers)]
    assert set(cache.keys()) == {(spec.kind, spec.layer) for spec in specs}
    for i, pair in enumerate(PAIRS):
        ids = alone(tokenizer, pair)
        t = ids.shape[1]
        with HookSession(model, []) as session:
            hooks = SiteHooks(model, specs, session)
            with torch.no_grad(), hooks.keep():
                forward_last(model, ids, torch.ones_like(ids))
        mine = cache.pair(i)
        for spec in specs:
            want = hooks.kept[spec.name][0]
            torch.testing.assert_close(mine[spec.kind, spec.layer], want, **TOL)
        assert mine["q", 0].shape == (t, 4, 8) and mine["k", 0].shape == mine["v", 1].shape == (t, 2, 8)
        assert mine["head", 1].shape == (t, 4, 8) and mine["pattern", 1].shape == (t, 4, t)
        torch.testing.assert_close(mine["pattern", 1].sum(-1), torch.ones(t, 4))  # each query's weights, no padding


def test_positions_last_keeps_each_sites_last_row(llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, _, run = llama
    sites = "method.sites=[resid_pre,k,pattern]"
    every = cached(tmp_path / "all", run, sites, "data.batch_size=3")
    last = cached(tmp_path / "last", run, sites, "data.batch_size=3", "method.positions=last")
    assert last.lengths.tolist() == [1, 1, 1] and last.prompt_lengths.tolist() == [8, 6, 8]
    for key in every.keys():
        for whole, end in zip(every.get(*key), last.get(*key), strict=True):
            torch.testing.assert_close(end, whole[-1:], **TOL)  # pattern: the last query over every real key
    table = load(tmp_path / "last")
    assert (table.first_position == table.length - 1).all()
    assert [list(t) for t in table[(table.site == "k") & (table.layer == 0)].tokens] == [["t03"], ["t12"], ["t07"]]


def test_batches_of_one_and_of_three_give_the_same_cache(llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The same keys, pairs, lengths, tokens and shapes; the same values up to float32 rounding (not bit for bit: the
    left-padded batch's attention runs over more keys, and its sums round in another order)."""
    _, _, run = llama
    sites = f"method.sites=[{','.join(EVERY_SITE)}]"
    one = cached(tmp_path / "one", run, sites, "data.batch_size=1")
    three = cached(tmp_path / "three", run, sites, "data.batch_size=3")
    assert len(list((tmp_path / "one" / "activations").iterdir())) == 3  # a file per batch
    assert len(list((tmp_path / "three" / "activations").iterdir())) == 1
    assert one.keys() == three.keys() and one.sample_ids == three.sample_ids
    assert torch.equal(one.lengths, three.lengths)
    for i in range(3):
        assert one.tokens(i) == three.tokens(i)
    for key in one.keys():
        assert one[key].shape == three[key].shape
        torch.testing.assert_close(one[key], three[key], **TOL)


def test_a_bfloat16_model_is_cached_in_float32_exactly(llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, _, run = llama
    cache = cached(tmp_path, run, "model.dtype=bfloat16", "method.sites=[resid_pre,head]", "data.batch_size=3")
    for key in cache.keys():
        for tensor in cache.get(*key):
            assert tensor.dtype == torch.float32 and torch.equal(tensor.bfloat16().float(), tensor)  # widened only


# ---- refused -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method.sites=[resid_pre,resid_psot]"],
         "method.sites=['resid_pre', 'resid_psot']: each one of resid_pre, resid_mid, resid_post, attn_out, mlp_out,"
         " head, q, k, v, pattern, latent, error, once (at least one). Did you mean: resid_post,"),
        (["method.sites=[head,head]"], "method.sites=['head', 'head']: each one of resid_pre,"),
        (["method.layers=[1,0,1]"], "method.layers=[1, 0, 1] names layer(s) [1] twice: give each layer once."),
        (["method.layers=[]"], "method.layers=[]: give at least one layer (null: every layer)."),
        (["method.layers=[2]"], "method.layers=[2]: the model has layers 0..1."),  # the model's config, no weights
        (["method.sites=[pattern]", "model.attn_implementation=sdpa"], "Site pattern needs the attention pattern"),
    ],
)  # fmt: skip
def test_bad_sites_and_layers_exit_2_with_one_line_before_the_model_loads(
    llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], message: str
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(app, "build_model", lambda cfg: pytest.fail("the model was built"))
    _, _, run = llama
    done = run_cli(*run, "method=lm_cache", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert not list(tmp_path.rglob("*.parquet")) and not list(tmp_path.rglob("*.safetensors"))


def test_debug_light_reads_four_layers_unless_layers_are_given() -> None:
    assert LmCacheConfig().lightened(30).layers == [0, 10, 19, 29]
    assert LmCacheConfig(layers=[3]).lightened(30).layers == [3]
    assert LmCacheConfig().selection().sites == ("resid_pre", "attn_out", "mlp_out")


# ---- the index and its files ---------------------------------------------------------------------------------------
def check_index(out: Path) -> set[str]:
    """Every committed row's file is whole and holds its key with its shape; no temporary is left. The files named."""
    with warnings.catch_warnings():  # an unfinished run's committed shards: `load` warns that they are not all
        warnings.simplefilter("ignore")
        table = load(out, "lm_cache", partial=True)
    for file, rows in table.groupby("file"):
        with safe_open(str(out / file), framework="pt") as handle:  # a partial file fails to open
            keys = set(handle.keys())
            for row in rows.itertuples():
                assert row.key in keys, (file, row.key)
                assert list(handle.get_slice(row.key).get_shape()) == list(row.shape)
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    return set(table.file)


@pytest.mark.slow
def test_the_index_names_whole_files_only_after_a_failure_and_a_resume(
    llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Shards of one pair: the second file's write fails half-way (a full disk), then the third shard's commit
    fails after its file is whole; each time the index lists the committed pairs only, every file it names is whole,
    and the resumed run completes the cache as an uninterrupted run makes it."""
    import safetensors.torch

    _, _, run = llama
    settings = [*run, "method=lm_cache", "method.sites=[resid_pre,q]", "data.batch_size=1", "output.shard_batches=1"]
    whole = cached(tmp_path / "whole", settings)
    assert check_index(tmp_path / "whole") == {f"activations/batch-00000{i}.safetensors" for i in range(3)}
    out = tmp_path / "run"
    save = safetensors.torch.save_file

    def disk_full_at_second(tensors: dict[str, torch.Tensor], path: str, *args: Any) -> None:
        if "batch-000001" in path:
            Path(path).write_bytes(b"\x10\x00\x00\x00")  # the first bytes of a header, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", path)
        save(tensors, path, *args)

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", disk_full_at_second)
        with pytest.raises(RunnerError, match="Cannot write results to .*: No space left on device"):
            app.run(make_config(*settings), out)
    assert check_index(out) == {"activations/batch-000000.safetensors"}
    assert not (out / "activations" / "batch-000001.safetensors").exists()
    with pytest.raises(RunnerError, match="holds an unfinished run"):
        load_activations(out)
    with pytest.warns(UserWarning, match=r"unfinished run \(1 of 3 shards complete\)"):
        assert load_activations(out, partial=True).sample_ids == ["pair-0"]

    commit = ShardedWriter.commit_shard

    def stop_before_third(self: ShardedWriter) -> None:
        if self._shard == 2:
            raise RuntimeError("killed between the file and the shard's commit")
        commit(self)

    with monkeypatch.context() as patch:
        patch.setattr(ShardedWriter, "commit_shard", stop_before_third)
        with pytest.raises(RuntimeError, match="killed between"):
            app.run(make_config(*settings), out)  # resumes: shard 0 kept, shard 1 runs, shard 2 fails to commit
    assert (out / "activations" / "batch-000002.safetensors").is_file()  # whole, and named by no row yet
    assert check_index(out) == {f"activations/batch-00000{i}.safetensors" for i in range(2)}

    app.run(make_config(*settings), out)
    resumed = load_activations(out)
    assert check_index(out) == {f"activations/batch-00000{i}.safetensors" for i in range(3)}
    assert resumed.keys() == whole.keys() and resumed.sample_ids == whole.sample_ids
    for key in whole.keys():
        assert torch.equal(resumed[key], whole[key])

    (out / "activations" / "batch-000001.safetensors").unlink()
    with pytest.raises(RunnerError, match=r"names 1 file\(s\) that are not there \(activations/batch-000001"):
        load_activations(out)


def test_a_run_that_fails_in_its_first_shard_leaves_no_activations_folder(
    llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    import safetensors.torch

    def fail(tensors: dict[str, torch.Tensor], path: str, *args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    _, _, run = llama
    with pytest.raises(RunnerError, match="No space left on device"):
        app.run(make_config(*run, "method=lm_cache", "data.batch_size=1"), tmp_path)
    assert not (tmp_path / "activations").exists() and not list(tmp_path.rglob("*.parquet"))
    with pytest.raises(RunnerError, match="holds no activation cache"):
        load_activations(tmp_path)
