"""Each extension point takes a new option as one module plus one YAML, with no central file edited: the examples
in docs/examples/extending/ (shown in docs/extending.md) are copied into a scratch copy of the runner and run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.conftest import TinyNet

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples" / "extending"
pytestmark = pytest.mark.slow


def scratch_with(example: str, tmp_path: Path) -> Path:
    """A copy of runner/ and conf/ with the example's files added (new files only: nothing is overwritten)."""
    scratch = tmp_path / "scratch"
    shutil.copytree(ROOT / "runner", scratch / "runner", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "conf", scratch / "conf")
    for file in sorted(p for p in (EXAMPLES / example).rglob("*") if p.is_file()):
        target = scratch / file.relative_to(EXAMPLES / example)
        assert not target.exists(), f"{target} exists: an example must only add files"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(file, target)
    return scratch


def run(scratch: Path, *overrides: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{scratch}{os.pathsep}{ROOT}"}
    return subprocess.run(
        [sys.executable, "-m", "runner", "debug=tiny", "progress=false", f"hydra.run.dir={out}", *overrides],
        cwd=scratch, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def table(out: Path, name: str) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(p) for p in sorted((out / f"{name}.parquet").glob("part-*.parquet"))])


@pytest.mark.process
def test_every_example_adds_only_new_files_and_keeps_the_import_contract(tmp_path: Path) -> None:
    examples = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    assert set(examples) == {"cam_variant", "metric", "model_source", "data_source", "target", "lm_method"}
    for example in examples:
        scratch = scratch_with(example, tmp_path / example)
        checked = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_imports.py"), str(scratch / "runner")],
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
        assert checked.returncode == 0, checked.stdout


@pytest.mark.process
def test_a_cam_variant_is_a_rule_class(tmp_path: Path) -> None:
    scratch = scratch_with("cam_variant", tmp_path)
    done = run(scratch, "method=gradcam_positive", out=tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    cam = table(tmp_path / "out", "cam")
    assert set(cam["method"]) == {"gradcam_positive"} and cam["cam_max"].notna().all()
    composed = run(scratch, "method=gradcam_positive", "method.store_map=false", out=tmp_path / "bad")
    assert composed.returncode == 2 and "store_map" in composed.stderr  # its schema is CamConfig's, checked


@pytest.mark.process
def test_a_metric_with_its_own_setting(tmp_path: Path) -> None:
    scratch = scratch_with("metric", tmp_path)
    done = run(scratch, "experiment=top_mass_effnet", out=tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = table(tmp_path / "out", "evaluation")
    values = rows.loc[rows["metric"] == "top_mass", "value"].dropna()
    assert len(values) and values.between(0.0, 1.0).all()
    bad = run(scratch, "experiment=top_mass_effnet", "+method.evaluation.settings.top_mass.fractoin=0.2",
              out=tmp_path / "bad")  # fmt: skip
    assert bad.returncode == 2 and "fractoin" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.process
def test_a_model_source_with_its_own_setting(tmp_path: Path) -> None:
    scratch = scratch_with("model_source", tmp_path)
    repo = tmp_path / "hub"
    repo.mkdir()
    (repo / "hubconf.py").write_text(
        "import torch\n\n"
        "def tiny(classes=5):\n"
        "    from tests.conftest import TinyNet\n"
        "    torch.manual_seed(0)\n"
        "    return TinyNet(classes)\n"
    )
    done = run(scratch, "model=hub_local", f"model.repo={repo}", "model.entry=tiny", "+model.kwargs.classes=3",
               "data=synthetic", "data.shape=[3,16,16]", "layers.include=[features.0,features.2]",
               out=tmp_path / "out")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    cam = table(tmp_path / "out", "cam")
    assert set(cam["model"]) == {"hub_local:tiny"} and set(cam["layer"]) == {"features.0", "features.2"}
    assert cam["predicted"].between(0, 2).all()  # the entry's kwargs reached the model: 3 classes
    assert isinstance(TinyNet(3), torch.nn.Module)


@pytest.mark.process
def test_a_data_source_in_its_own_module(tmp_path: Path) -> None:
    scratch = scratch_with("data_source", tmp_path)
    done = run(scratch, "data=checkerboards", "data.squares=4", "data.count=3", "data.limit=null", out=tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    cam = table(tmp_path / "out", "cam")
    assert set(cam["sample_id"]) == {"checkerboard-0", "checkerboard-1", "checkerboard-2"}
    assert set(cam["label"]) <= {0, 1}
    bad = run(scratch, "data=checkerboards", "data.squares=0", out=tmp_path / "bad")
    assert bad.returncode == 2 and "data.squares=0" in bad.stderr


@pytest.mark.process
def test_a_target_with_its_own_setting(tmp_path: Path) -> None:
    scratch = scratch_with("target", tmp_path)
    scores = {}
    for scale in (1, 2):
        out = tmp_path / f"out{scale}"
        done = run(scratch, "target=margin", f"target.scale={scale}", out=out)
        assert done.returncode == 0, done.stderr[-2000:]
        scores[scale] = table(out, "cam").sort_values(["sample", "layer", "call"])["score"].to_numpy()
    assert abs(scores[2] - 2 * scores[1]).max() < 1e-5 * abs(scores[1]).max()  # the setting reached the score
    assert (scores[1] != 0).any()


@pytest.mark.process
def test_a_language_model_method_reads_its_sites_through_the_hook_session(tmp_path: Path) -> None:
    """method=lm_stream_norm on the shipped induction model: each layer's clean and corrupted norms at the last
    position equal a plain transformers forward's (output_hidden_states: the embeddings, then each block's output,
    except the last entry, which is after the final norm: the last block's output is the final norm's input), 1e-5
    relative; the ratio is corrupted / clean; a bad setting is refused in one line before the weights load."""
    import importlib.resources
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    scratch = scratch_with("lm_method", tmp_path)
    lm = ("model=hf_lm", "data=prompts", "data.file=induction", "method=lm_stream_norm")
    done = run(scratch, *lm, "method.sites=[resid_pre,resid_post]", out=tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = table(tmp_path / "out", "lm_stream_norm")
    assert len(rows) == 2 * 2 * 2  # debug=tiny: 2 pairs x 2 sites x 2 layers

    folder = Path(str(importlib.resources.files("runner.models") / "lm_induction"))
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    pairs = [json.loads(line) for line in (folder / "induction_pairs.jsonl").read_text().splitlines()]
    final_input: list[torch.Tensor] = []
    model.model.norm.register_forward_pre_hook(lambda module, args: final_input.append(args[0]))
    last = model.config.num_hidden_layers - 1
    for row in rows.itertuples():
        for prompt, column in (("clean", "clean_norm"), ("corrupted", "corrupted_norm")):
            ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(pairs[row.sample][prompt])["input_ids"]]])
            final_input.clear()
            with torch.no_grad():
                states = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            if row.site == "resid_pre":
                stream = states[row.layer]
            else:
                stream = final_input[0] if row.layer == last else states[row.layer + 1]
            want = float(stream[0, -1].norm())
            assert abs(getattr(row, column) - want) <= 1e-5 * want, (row, column, want)
        assert row.ratio == pytest.approx(row.corrupted_norm / row.clean_norm, rel=1e-6)
    assert (rows["ratio"] - 1).abs().max() > 0.01  # the corrupted prompt's stream differs: not the clean one twice

    for bad, words in (("method.layers=[7]", "method.layers=[7]: the model has layers 0..1"),
                       ("method.sites=[head]", "method.sites=['head']: per-head sites")):  # fmt: skip
        refused = run(scratch, *lm, bad, out=tmp_path / "bad")
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and words in lines[0], refused.stderr[-2000:]
        assert "model induction" not in refused.stdout + refused.stderr  # refused by `planned`, before any weights
