"""The memory plan (runner/plan.py, runner/methods/lm_edges/plan.py, `runner plan`): counts from the config alone,
the traced run's bytes on meta equal to the real run's, the planned peak against the measured one (torch's
allocations against the plan's tensors; a run's peak resident memory against the CPU's whole plan), and the refusal
of a run that will not fit before its weights load."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import runner.app
import runner.plan
from runner.hooks import HookSession
from runner.methods.lm.base import forward_last
from runner.methods.lm_edges.graph import EdgeGraph
from runner.methods.lm_edges.intervene import EdgeRuns
from runner.methods.lm_edges.plan import _forward
from runner.models import model_tokenizer
from runner.models.lm_sites import layout_of
from runner.models.memory import PEAK_RSS_PROBE, peak_bytes, traced_bytes
from runner.plan import run_plan
from tests.conftest import make_config, run_cli
from tests.lm_references import build_tiny_lm

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "conf" / "model_configs"
# a random Llama from the induction model's config: 3 layers, 96 wide, 4 query heads sharing 2 key-value heads
SMALL = ["experiment=edges_lm_induction", "model.weights=null", "+model.config.num_hidden_layers=3",
         "+model.config.hidden_size=96", "+model.config.num_attention_heads=4", "+model.config.num_key_value_heads=2",
         "+model.config.head_dim=24", "+model.config.intermediate_size=384", "method.edges.steps=2",
         "method.edges.resamples=0", "method.edges.circuit=[]", "method.edges.fractions=[0.1,0.5]"]  # fmt: skip


def _edges_by_hand(layers: int, heads: int, kv: int) -> int:
    """Edges of a sequential grouped-query model counted reader by reader: a head's query and each key-value head's
    key and value read every writer of the layers before (the embeddings, each head, each MLP); a layer's MLP reads
    those and its own layer's heads; the logits read every writer."""
    writers_before = [1 + layer * (heads + 1) for layer in range(layers)]
    attention = sum((heads + 2 * kv) * w for w in writers_before)
    mlps = sum(w + heads for w in writers_before)
    return attention + mlps + 1 + layers * (heads + 1)


@pytest.mark.slow
@pytest.mark.parametrize(("folder", "sizes"), [("llama-3.1-8b", (32, 32, 8)), ("qwen2.5-0.5b", (24, 14, 2))])
def test_shipped_configs_plan_their_edges_without_weights(folder: str, sizes: tuple[int, int, int]) -> None:
    result = run_cli("plan", "experiment=ioi_edges_smollm2", f"model.name={CONFIGS / folder}",
                     "model.tokenizer=smollm2-135m", "model.dtype=bfloat16", "--free", "1000")  # fmt: skip
    assert result.returncode == 0, result.stderr
    counts = result.stdout.splitlines()[0]
    assert f"edges {_edges_by_hand(*sizes):,}" in counts, counts
    assert "fits" in result.stdout.splitlines()[-1]


def test_the_traced_run_on_meta_holds_what_the_real_run_holds() -> None:
    """traced_bytes on the meta device (shapes only) equals the same sum over the real run's saved tensors and
    views, on a grouped-query Llama."""
    model, _, _ = build_tiny_lm("llama", seed=0)
    for p in model.parameters():
        p.requires_grad_(False)
    layout = layout_of(model)
    graph = EdgeGraph.of(layout)
    figures = []
    for device in ("cpu", "meta"):
        here = model if device == "cpu" else model.to("meta")
        ids = torch.zeros(3, 7, dtype=torch.long, device=device)
        mask = torch.ones(3, 7, dtype=torch.long, device=device)
        with HookSession(here, []) as session:
            hooks = EdgeRuns(here, layout, graph, session)
            figures.append(traced_bytes(here, lambda h=here, i=ids, m=mask: forward_last(h, i, m),
                                        lambda hooks=hooks: hooks.keep(grad=True), lambda hooks=hooks: hooks.kept))  # fmt: skip
    assert figures[0] > 0
    assert figures[0] == figures[1]


@pytest.mark.slow
@pytest.mark.parametrize("evaluation", [[], ["method.edges.fractions=[]", "method.edges.top_k=0"]])
def test_the_planned_tensors_are_within_a_fifth_of_torchs_allocations(tmp_path: Path, evaluation: list[str]) -> None:
    """The run's whole peak of torch's allocations (the weights load inside it), with its evaluation pass and
    without (then the scoring pass's peak: the traced run, the readers' gradients, the writes)."""
    config = make_config(*SMALL, "data.batch_size=16", *evaluation)
    plan = run_plan(config, torch.device("cpu"), free=2**50)
    assert plan.method.peak.name == ("scoring" if evaluation else "exact edges")
    _, measured = peak_bytes(lambda: runner.app.run(config, tmp_path), torch.device("cpu"))
    print(f"planned {plan.tensors / 1e6:.1f} MB ({plan.method.peak.name}), measured {measured / 1e6:.1f} MB")
    assert abs(plan.tensors / measured - 1) <= 0.2


def test_the_cpu_plan_holds_the_process_and_the_scoring_pass_freed_memory() -> None:
    """On the CPU the plan is of resident memory: the process (imports, model code) and the tokenizer through every
    phase, and the scoring pass's tensors beyond the weights through the evaluation's phases; on a GPU the method's
    tensors alone."""
    config = make_config(*SMALL, "data.batch_size=16")
    cpu = run_plan(config, torch.device("cpu"), free=2**50)
    process = dict(cpu.process)
    assert process["the process (Python, torch, transformers)"] == runner.plan.PROCESS_BYTES
    assert process["the tokenizer"] == runner.plan.TOKENIZER_BYTES * len(model_tokenizer(config.model))
    tensors = {phase.name: phase for phase in cpu.method.phases}
    scoring = tensors["scoring"]
    freed = scoring.total - dict(scoring.terms)["weights"]
    for phase in cpu.phases:
        assert phase.total == tensors[phase.name].total + (0 if phase.name == "scoring" else freed), phase.name
    assert cpu.peak == cpu.peak_phase.total + sum(process.values())
    assert cpu.peak > cpu.tensors + runner.plan.PROCESS_BYTES
    gpu = run_plan(config, torch.device("cuda"), free=2**50)
    assert gpu.process == [] and gpu.peak == gpu.tensors == cpu.tensors


def test_a_forward_whose_logits_are_wider_than_a_block_is_planned_at_its_logits() -> None:
    """Gemma 3's 262,144-token vocabulary: 256 rows' logits (268 MB, and the metric's copies) outweigh a block's
    activations (about 150 MB); a small vocabulary leaves the block the widest point."""
    layout = SimpleNamespace(heads=4)
    block = _forward(layout, 640, 2048, 15, 4, 256, 0, 128)  # type: ignore[arg-type]
    assert _forward(layout, 640, 2048, 15, 4, 256, 49_152, 128) == block  # type: ignore[arg-type]
    wide = _forward(layout, 640, 2048, 15, 4, 256, 262_144, 128)  # type: ignore[arg-type]
    assert wide == 256 * 262_144 * 4 + 2 * 128 * 262_144 * 4 > block
    bf16 = _forward(layout, 640, 2048, 15, 2, 256, 262_144, 128)  # type: ignore[arg-type]
    assert bf16 == 256 * 262_144 * (2 + 4) + 2 * 128 * 262_144 * 4  # bfloat16 logits and their float32 copy


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status, the process constant measured: Linux")
def test_the_planned_peak_is_within_a_fifth_of_the_runs_peak_resident_memory(tmp_path: Path) -> None:
    """The CPU's whole plan against the peak resident memory of the same run as its own process: without the
    process's own memory (imports, model code, tokenizer: over a gigabyte) the plan of this small model would be a
    tenth of the measured peak."""
    overrides = [*SMALL, "data.batch_size=16"]
    plan = run_plan(make_config(*overrides), torch.device("cpu"), free=2**50)
    args = [*overrides, "progress=false", "method.pictures=false", f"hydra.run.dir={tmp_path / 'out'}"]
    done = subprocess.run([sys.executable, "-c", PEAK_RSS_PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TQDM_DISABLE": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    measured = int(done.stderr.rsplit("PEAK_RSS_KIB", 1)[1].split()[0]) * 1024
    print(f"planned {plan.peak / 1e9:.3f} GB ({plan.peak_phase.name}), measured {measured / 1e9:.3f} GB")
    assert abs(plan.peak / measured - 1) <= 0.2
    assert plan.tensors < 0.5 * measured  # what the plan held before: torch's allocations alone


@pytest.mark.slow
def test_a_run_that_will_not_fit_is_refused_before_the_weights_load(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    config = make_config(*SMALL, "data.batch_size=16")
    plan = run_plan(config, torch.device("cpu"), free=2**50)
    assert plan.process  # the CPU's plan counts the process, and the refusal counts it
    free = plan.peak - 1  # one byte short
    monkeypatch.setattr(runner.plan, "available_bytes", lambda device: free)
    monkeypatch.setattr(runner.plan, "resident_bytes", lambda: 0)  # as though nothing of it were resident yet

    def loaded(cfg):  # type: ignore[no-untyped-def]
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(runner.app, "build_model", loaded)
    with pytest.raises(runner.app.RunnerError, match="at its peak") as refused:
        runner.app.run(config, tmp_path / "out")
    message = str(refused.value)
    assert "runner plan" in message
    assert not list((tmp_path / "out").glob("*.parquet"))
    named = re.findall(r"((?:data|model|method)\.[\w.]+=\w+) \(", message)  # each setting it names, and its peak
    assert named, message
    for setting in named:  # each fits where the run did not
        assert run_plan(make_config(*SMALL, "data.batch_size=16", setting), torch.device("cpu"), free=free).fits


@pytest.mark.slow
def test_plan_command_says_what_fits_and_exits_1_when_nothing_is_free() -> None:
    result = run_cli("plan", *SMALL, "data.batch_size=16", "--free", "0.0001")
    assert result.returncode == 1, result.stderr
    assert "does not fit" in result.stdout
    assert "fits with:" in result.stdout
    refused = run_cli("plan", "experiment=gradcam_effnet")
    assert refused.returncode == 2
    assert "no memory plan" in refused.stderr


def test_the_memory_this_process_holds_already_is_not_counted_twice(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The system's free memory is without this process's resident memory: a plan that reads the free memory counts
    only what the run needs beyond what the process holds already (at most the plan's process terms)."""
    config = make_config(*SMALL, "data.batch_size=16")
    whole = run_plan(config, torch.device("cpu"), free=2**50)
    process = sum(size for _, size in whole.process)
    monkeypatch.setattr(runner.plan, "resident_bytes", lambda: 10**12)  # more than the process terms: capped
    monkeypatch.setattr(runner.plan, "available_bytes", lambda device: whole.peak - process)
    plan = run_plan(config, torch.device("cpu"))
    assert plan.held == process and plan.peak == whole.peak and plan.fits
    monkeypatch.setattr(runner.plan, "available_bytes", lambda device: whole.peak - process - 1)
    assert not run_plan(config, torch.device("cpu")).fits
    assert run_plan(config, torch.device("cpu"), free=whole.peak - 1).held == 0  # a free figure given: another device
