"""The config tree composes into the typed schema; typos and wrong types fail at start-up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from runner.errors import RunnerError
from runner.models import model_label
from runner.schema import HookAction, HookKind, Precision, RunConfig
from tests.conftest import CONF, make_config, run_cli


def test_default_composes_to_typed_objects() -> None:
    cfg = make_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.model.name == "efficientnet_lite0" and cfg.data.name == "skimage_photos"
    assert {h.kind for h in cfg.hooks} == set(HookKind)  # the default records all four kinds
    assert all(isinstance(h.action, HookAction) for h in cfg.hooks)
    assert cfg.precision is Precision.fp32


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_composes(experiment: str) -> None:
    cfg = make_config(f"experiment={experiment}")
    assert cfg.name == experiment
    # for_model names the experiment's own model: with no override the experiment's selection is the run's.
    assert cfg.for_model.model == model_label(cfg.model), "for_model.model: the experiment's model's label"
    from runner.methods import method_class

    if method_class(cfg.method).modality == "text":  # a language model's method names sites or layers, not modules
        assert not cfg.for_model.include and not cfg.hooks
        if cfg.method.name == "lm_patching":
            assert cfg.method.patching.sites
        return
    assert cfg.layers.include, "every experiment selects target layers"
    assert cfg.layers.include == cfg.for_model.include and cfg.hooks == cfg.for_model.hooks


@pytest.mark.parametrize(
    "override",
    [
        "model.nmae=vgg16",  # misspelled key
        "+model.nmae=vgg16",  # `+` cannot smuggle in a key the schema lacks
        "data.batch_size=four",  # wrong type
        "precision=fp8",  # not in the enum
        "hooks=[{kind: sideways}]",  # unknown hook kind
        "hooks=[{kind: forward, action: explode}]",  # unknown action
    ],
)
def test_bad_config_fails_at_composition(override: str) -> None:
    with pytest.raises((ConfigCompositionException, ValidationError, RunnerError)) as info:
        make_config(override)
    message = str(info.value) + str(getattr(info.value, "__cause__", ""))
    assert any(word in message for word in ("nmae", "four", "fp8", "sideways", "explode"))


# ---- each option owns its schema ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "key", "owner", "chosen"),
    [
        (["method.patching.grid=[3,3]"], "method.patching", "method=patching", "method=gradcam"),
        (["method.tolerance=0.5"], "method.tolerance", "method=hook_check", "method=gradcam"),
        (["method=hook_check", "method.store_maps=false"], "method.store_maps", "method=", "method=hook_check"),
        (["method=record", "method.faithfulness.enabled=true"], "method.faithfulness", "method=", "method=record"),
        (["data=synthetic", "data.root=/x"], "data.root", "data=image_folder / torchvision", "data=synthetic"),
        (["data=image_folder", "data.photos=[chelsea]"], "data.photos", "data=skimage_photos", "data=image_folder"),
        (["data.count=3"], "data.count", "data=synthetic", "data=skimage_photos"),
    ],
)
def test_a_key_of_another_option_fails_at_composition(overrides: list[str], key: str, owner: str, chosen: str) -> None:
    from runner.options.compose import config_error_line

    with pytest.raises(ConfigCompositionException) as info:
        make_config(*overrides)
    line = config_error_line(info.value.__cause__)
    assert "\n" not in line and f"(key: {key})" in line
    owners = set(line.split("belongs to ")[1].split(", not to")[0].split("=", 1)[1].split(" / "))
    assert {name for name in owner.split("=")[1].split(" / ") if name} <= owners and f"not to {chosen}" in line


def test_plus_cannot_smuggle_in_a_key_of_another_option() -> None:
    with pytest.raises(
        RunnerError, match=r"key: method.patching\).*belongs to method=patching / lm_patching, not to method=gradcam"
    ):
        make_config("+method.patching.grid=[3,3]")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["method=gradcam", "method.patching.grid=[3,3]"], "method.patching"),
        (["data=synthetic", "data.root=/x"], "data.root"),
    ],
)
def test_cli_names_the_stray_key_in_one_line_and_exits_2(tmp_path: Path, overrides: list[str], key: str) -> None:
    done = run_cli(*overrides, f"hydra.run.dir={tmp_path}")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[ERROR] Config error") and f"(key: {key})" in lines[0], done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("group", ["method", "data"])
def test_every_option_composes_to_its_own_schema(group: str) -> None:
    from runner.options.registry import option_schemas

    schemas = option_schemas()[group]
    options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    assert options and set(options) <= set(schemas), "every YAML option has a registered schema"
    for option in options:
        text = (CONF / group / f"{option}.yaml").read_text()
        assert f"- /schema/{group}/{option}@_here_" in text  # the option's YAML starts from its schema
        assert type(getattr(make_config(f"{group}={option}"), group)) is schemas[option]


def test_an_option_named_by_string_builds_its_own_config() -> None:
    from runner.data.base import data_config
    from runner.methods import method_config
    from runner.methods.patching import PatchingConfig, PatchingMethodConfig
    from runner.options.data.synthetic import SyntheticConfig
    from runner.options.method.scorecam import ScoreCamConfig

    scorecam = method_config("scorecam", score_chunk=2)
    assert type(scorecam) is ScoreCamConfig and scorecam.score_chunk == 2
    assert type(method_config("patching", patching=PatchingConfig(grid=[3, 3]))) is PatchingMethodConfig
    assert type(data_config("synthetic", count=2)) is SyntheticConfig
    with pytest.raises(TypeError, match="patching"):
        method_config("gradcam", patching=PatchingConfig())
    with pytest.raises(TypeError, match="root"):
        data_config("synthetic", root="/x")
    with pytest.raises(RunnerError, match="Unknown method 'gradcan'.*gradcam"):
        method_config("gradcan")


def test_run_loop_names_no_method() -> None:
    """What `run()` once special-cased (record's layers, patching's data set, hook_check's verdict) is the
    method protocol's; the core modules import no method's module (annotations under TYPE_CHECKING aside)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_imports", CONF.parent / "scripts" / "check_imports.py")
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = check  # its dataclasses look their module up
    spec.loader.exec_module(check)
    core = [CONF.parent / "runner" / name for name in ("app.py", "loop.py", "ids.py")]
    modules = {check.module_name(p, CONF.parent / "runner") for p in (CONF.parent / "runner").rglob("*.py")}
    for path in core:
        imported = {i.imported for i in check.imports_of(path, f"runner.{path.stem}", modules)}
        assert not {m for m in imported if m.startswith("runner.methods.")}, path.name
        source = path.read_text()
        for special in ("HookCheck", "bind_dataset", '!= "record"'):
            assert special not in source, f"{path.name}: {special}"


# ---- one registry shape for the five extension points --------------------------------------------------------------
def test_every_group_uses_the_one_extension_point_shape() -> None:
    from runner.data.base import data_config_class
    from runner.methods import method_config_class
    from runner.options.data.synthetic import SyntheticConfig
    from runner.options.method.gradcam import GradCam
    from runner.options.registry import DATA, METHODS, METRICS, MODELS, POINTS, TARGETS, ExtensionPoint

    assert set(POINTS) == {"model", "data", "target", "method", "metric"}
    assert all(isinstance(point, ExtensionPoint) for point in (METHODS, DATA, MODELS, METRICS, TARGETS))
    assert method_config_class("gradcam") is GradCam.config  # type: ignore[attr-defined]
    assert data_config_class("synthetic") is SyntheticConfig
    assert {"gradcam", "patching", "record"} <= set(METHODS.names())
    assert set(MODELS.names()) == {"torchvision", "embedded", "target", "timm", "hf", "hf_lm"}
    with pytest.raises(RunnerError, match=r"Unknown data source 'synthtic'\. Did you mean: synthetic\? Available: "):
        data_config_class("synthtic")


def test_every_option_names_an_implementation_that_exists() -> None:
    """An option's implementation is imported only when a run uses it: each must resolve, and a method's class
    must write the table its option declares first."""
    from runner.options.registry import POINTS

    for point in POINTS.values():
        for option in point:
            implementation = option.load()
            assert implementation is not None, option
            if point.group == "method":
                assert implementation.table == option.tables[0], option.name


def test_extension_point_refuses_a_second_option_of_one_name() -> None:
    from dataclasses import dataclass

    from runner.options.registry import ExtensionPoint

    point = ExtensionPoint("thing", "thing", "runner.options.method")

    @point.option("x:A")
    @dataclass
    class A:
        name: str = "a"

    @dataclass
    class B:
        name: str = "a"

    with pytest.raises(ValueError, match="'a' is registered twice"):
        point.option("x:B")(B)
    with pytest.raises(RunnerError, match=r"Unknown thing 'b'\. Available: a\."):
        point.get("b")


def test_the_base_config_is_refused_not_guessed() -> None:
    """Without the old `__new__` shims, a base config names an option but holds none of its keys."""
    from runner.data.base import build_dataset
    from runner.methods import method_class
    from runner.schema import DataConfig, MethodConfig

    with pytest.raises(RunnerError, match=r"data=synthetic needs its own config \(SyntheticConfig\)"):
        build_dataset(DataConfig(name="synthetic"), None, 0)
    with pytest.raises(RunnerError, match=r"method=gradcam needs its own config \(GradCamConfig\)"):
        method_class(MethodConfig(name="gradcam"))


@pytest.mark.parametrize("override", ["figures.dpi=0", "figures.columns=0", "figures.format=gif"])
def test_bad_figure_settings_are_refused_before_the_run(override: str) -> None:
    with pytest.raises((ConfigCompositionException, ValidationError, RunnerError)) as info:
        make_config(override)
    assert override.split("=")[0].split(".")[1] in str(info.value) + str(getattr(info.value, "__cause__", ""))


def test_the_store_is_registered_once_and_shared_not_copied_per_composition() -> None:
    """Hydra deep-copies its config repository once per composition (125 times for `--hydra-help`); the ConfigStore
    rides along unless shared. Shared, a node the store hands out is still Hydra's own copy."""
    import copy
    import pickle
    from unittest import mock

    from hydra.core.config_store import ConfigStore

    from runner.options.compose import register_configs

    store = ConfigStore.instance()
    assert copy.deepcopy(store) is store
    sent = pickle.loads(pickle.dumps(store))  # as a launcher sends it to its workers: still shared, not copied
    assert copy.deepcopy(sent) is sent and sent.repo.keys() == store.repo.keys()
    with mock.patch.object(store, "store", wraps=store.store) as stored:
        register_configs()  # conftest registered the same schemas
    assert stored.call_count == 0
    loaded = store.load("schema/method/lm_edges.yaml")
    loaded.node.edges.steps = 999
    assert store.load("schema/method/lm_edges.yaml").node.edges.steps != 999
    assert make_config("experiment=ioi_edges_smollm2").method.edges.steps == 5
