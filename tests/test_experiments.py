"""Every experiment in conf/experiment/ runs at `debug=tiny` (32 px, two samples), writes its tables with
rows, and leaves no hook on its model: a new or edited experiment file cannot rot unnoticed."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

import runner.app as app
import runner.models
from runner.hooks import count_hooks
from runner.models.embedded import EMBEDDED
from runner.options.model.hf_lm import SHIPPED_LM
from tests.conftest import CONF, make_config, stand_in_for
from tests.devices import DEVICE_PARAMS
from tests.lm_references import build_word_lm, prompt_words

SMOLLM2 = "smollm2-135m"
GEMMA3 = "gemma3-270m"

pytestmark = pytest.mark.slow

EXPERIMENTS = sorted(path.stem for path in (CONF / "experiment").glob("*.yaml"))
# The tables each experiment writes (its method's table; `hooks` where it configures hooks). A new
# experiment fails here until it is listed: say what it should write.
EDGE_TABLES = {"lm_edges", "lm_edge_pair_scores", "lm_circuit", "lm_circuit_curve", "lm_circuit_scores",
               "lm_circuit_stability", "lm_edge_exact", "lm_edge_calibration"}  # fmt: skip
SAE_TABLES = {"train_sae", "train_sae_steps", "train_sae_features", "train_sae_windows"}
TABLES = {
    "attribution_patching_effnet": {"patching"},
    "attribution_patching_lm": {"lm_patching"},
    "causal_tracing_lm": {"lm_patching"},
    "patching_lm_induction": {"lm_patching"},
    "patching_lm_ioi": {"lm_patching"},
    "ioi_smollm2": {"lm_patching"},
    "factual_recall_smollm2": {"lm_patching"},
    "ioi_attention_smollm2": {"lm_attention"},
    "edges_lm_induction": EDGE_TABLES,
    "edges_mib_lm_induction": EDGE_TABLES,
    "ioi_edges_smollm2": EDGE_TABLES,
    "ioi_edge_positions_smollm2": EDGE_TABLES,
    "ioi_edges_smollm2_templates": EDGE_TABLES,
    "ioi_gemma3": {"lm_patching"},
    "factual_recall_gemma3": {"lm_patching"},
    "ioi_edges_gemma3": EDGE_TABLES,
    "ioi_paths_smollm2": {"lm_edges", "lm_edge_pair_scores", "lm_paths"},
    "ioi_dla_smollm2": {"lm_dla"},
    "ioi_features_smollm2": {"lm_patching"},
    "ioi_cache_smollm2": {"lm_cache"},
    "train_sae_induction": SAE_TABLES,
    "train_sae_smollm2": SAE_TABLES,
    "cam_vs_patching_effnet": {"cam_vs_patching"},
    "evaluate_effnet": {"cam", "evaluation"},
    "localisation_effnet": {"cam", "evaluation"},
    "mprt_effnet": {"mprt"},
    "check_hooks_effnet": {"hook_check"},
    "default": {"cam", "hooks"},
    "gradcam_effnet": {"cam"},
    "gradcam_resnet50": {"cam"},
    "gradcam_vgg16": {"cam"},
    "gradcam_vit": {"cam"},
    "hooks_vgg16": {"hooks"},
    "patching_channels": {"patching"},
    "patching_effnet": {"patching"},
    "patching_vgg16": {"patching"},
    "sanity_randomization": {"sanity"},
}
# tables whose rows are about the whole run (no sample)
RUN_ROWS = {"lm_edges", "lm_circuit_curve", "lm_circuit_scores", "lm_circuit_stability", "lm_edge_calibration",
            "train_sae", "train_sae_steps", "train_sae_features"}  # fmt: skip
ONE_PHOTO = {"patching_channels", "patching_effnet"}  # they set data.photos: [chelsea]
# Settings that name SmolLM2's layers (23.3's query, layers 23 and 29): its two-layer stand-in gets its own
STAND_IN_PATHS = {
    "ioi_paths_smollm2": ["method.edges.paths=[{senders: ['a0.*'], receivers: ['a1.h0<q>', logits]}]"],
    "ioi_cache_smollm2": ["method.layers=[0,1]"],
    "train_sae_smollm2": ["method.layer=1"],
}


@pytest.fixture
def built_models(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every model a run builds, wherever the runner imported `build_model` from runner.models."""
    seen: list = []
    original = runner.models.build_model

    def spy(cfg):  # noqa: ANN001, ANN202
        bundle = original(cfg)
        seen.append(bundle.model)
        return bundle

    for module in [m for name, m in sys.modules.items() if name.startswith("runner")]:
        if getattr(module, "build_model", None) is original:
            monkeypatch.setattr(module, "build_model", spy)
    return seen


def offline(name: str, folder: Path) -> list[str]:
    """What an experiment needs to run here: torchvision models have no cached weights (random init); the
    embedded EfficientNet-Lite0 and the shipped induction LM keep their real weights. ViT-B/16 takes only its own
    image size: 32 px. A hub language model (GPT-2 small) is neither cached nor downloadable: a random two-layer
    GPT-2 with a word-level tokenizer over the experiment's words stands in, saved in `folder`. SmolLM2-135M (30
    layers: minutes even at debug=tiny) is stood in for by a random two-layer Llama with its own tokenizer, which
    gets no answer right, so every pair is kept (data.keep=all; tests/test_lm_prompt_sets.py tests the keeping);
    Gemma 3 270M by a random two-layer Gemma 3 with its tokenizer (its own blocks: norms after each branch)."""
    config = make_config(f"experiment={name}")
    model = config.model.name
    if model in (EMBEDDED, SHIPPED_LM):
        return []
    if model == SMOLLM2:
        keep = ["data.keep=all"] if hasattr(config.data, "keep") else []  # prompt pairs (not data=text's windows)
        stand_in = stand_in_for(SMOLLM2, folder)
        return [f"model.name={stand_in}", *keep, *STAND_IN_PATHS.get(name, []),
                *stand_in_dictionaries(config, stand_in, folder)]  # fmt: skip
    if model == GEMMA3:
        return [f"model.name={stand_in_for(GEMMA3, folder, same_family=True)}", "data.keep=all"]
    if config.model.source == "hf_lm":
        return [f"model.name={build_word_lm(prompt_words(config.data), folder)}"]
    return ["model.weights=null", *(["+model.kwargs.image_size=32"] if model.startswith("vit") else [])]


def stand_in_dictionaries(config: object, stand_in: Path, folder: Path) -> list[str]:
    """An experiment that splices dictionaries into SmolLM2 (trained by another run) gets a random TopK SAE of the
    stand-in's width at its last layer instead, where the experiment's sites then are."""
    placed = config.model.dictionaries  # type: ignore[attr-defined]
    if not placed:
        return []
    import json

    from runner.dictionaries.formats import save_saelens
    from tests.test_dictionary_splice import random_dictionary

    width = json.loads((stand_in / "config.json").read_text())["hidden_size"]
    path = folder / "stand_in_sae"
    if not path.exists():
        save_saelens(random_dictionary(width, "topk"), path, "blocks.1.hook_resid_post", "stand-in")
    site = placed[0].site
    return [f"model.dictionaries=[{{path: {path}, site: {site}, layer: 1}}]", "method.patching.layers=[1]"]


def test_debug_tiny_keeps_the_progress_bar() -> None:
    """A tiny run can still take minutes (a timm model, patching): its bar stays (tests turn it off themselves)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        assert compose(config_name="config", overrides=["debug=tiny"]).progress is True


def test_debug_tiny_wins_over_the_experiment_and_yields_to_the_command_line() -> None:
    config = make_config("experiment=gradcam_vgg16", "debug=tiny", "data.batch_size=3")
    assert (config.data.image_size, config.data.limit, config.data.batch_size) == (32, 2, 3)
    assert config.method.pictures is False
    assert config.layers.include == ["features.*:Conv2d"]  # the experiment's layers are kept
    assert make_config("experiment=patching_effnet", "debug=tiny").data.photos == ["chelsea"]
    assert make_config().data.image_size == 224  # off by default


def test_every_experiment_is_listed() -> None:
    assert set(EXPERIMENTS) == set(TABLES), "list each experiment's tables in TABLES"


# Where debug=tiny alone still takes long, the run made smaller: this test checks the run's wiring and tables, the
# values are checked elsewhere (ROAD and faithfulness correlation against Quantus: tests/test_metrics.py).
# evaluate_effnet: ROAD at 3 of its 50 points, faithfulness correlation with 10 random subsets of its 100 (24 s at
# 32 px otherwise, 2,800 sparse solves).
SMALLER = {
    "evaluate_effnet": [
        "method.evaluation.road_percentages=[9,49,89]",
        "method.evaluation.faithfulness_correlation_runs=10",
    ],
    "train_sae_smollm2": ["method.steps=20"],  # 1,000 steps of a 2,048-latent SAE: tested in tests/test_train_sae.py
}


@pytest.mark.parametrize("device", DEVICE_PARAMS)  # cuda where there is one, marked gpu (`make test-gpu`)
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_runs_at_tiny_size(tmp_path: Path, built_models: list, name: str, device: str) -> None:
    overrides = [f"experiment={name}", "debug=tiny", f"device={device}", *offline(name, tmp_path / "lm"),
                 *SMALLER.get(name, [])]  # fmt: skip
    result = app.run(make_config(*overrides), tmp_path)
    assert set(result.tables) == TABLES.get(name, set())
    for table, path in result.tables.items():
        frame = pd.read_parquet(path)
        assert len(frame) > 0, table
        if table in RUN_ROWS:  # about the whole run: debug=tiny's two pairs (none held out) behind each row
            assert frame["sample"].isna().all(), table
            assert "pairs" not in frame or set(frame["pairs"]) <= {0, 1, 2}, table
            continue
        assert set(frame["sample"]) == ({0} if name in ONE_PHOTO else {0, 1}), table  # debug=tiny: data.limit=2
    assert built_models and all(count_hooks(model) == 0 for model in built_models)


def test_captum_leaves_no_hook(tmp_path: Path, built_models: list) -> None:
    """captum registers its own hooks inside `attribute` (runner/hooks/__init__.py's one exception): none survives."""
    result = app.run(make_config("method=captum", "debug=tiny", "hooks=[]", "layers.include=[_blocks.5]"), tmp_path)
    assert len(pd.read_parquet(result.tables["cam"])) == 2
    assert built_models and count_hooks(built_models[0]) == 0
