"""Models: real embedded weights, strict checkpoints, clear errors, never a silent random fallback."""

from __future__ import annotations

import urllib.error
from pathlib import Path

import pytest
import torch

from runner.data.images import standard_transform
from runner.errors import RunnerError
from runner.models import build_model, load_checkpoint
from runner.schema import ModelConfig, ResizeMode
from tests.conftest import TinyNet


def test_embedded_efficientnet_lite0_is_really_pretrained() -> None:
    import skimage.data
    from PIL import Image

    bundle = build_model(ModelConfig(name="efficientnet_lite0", weights="embedded"))
    x = standard_transform(224, ResizeMode.square)(Image.fromarray(skimage.data.chelsea()))[None]
    probs = bundle.model(x).softmax(-1)
    assert int(probs.argmax()) == 285 and bundle.categories[285] == "Egyptian cat"
    assert float(probs.max()) > 0.5  # random weights would give ~1/1000
    assert all(not p.requires_grad for p in bundle.model.parameters())


def test_unknown_model_suggests_names() -> None:
    with pytest.raises(RunnerError, match="Unknown model 'vgg61'.*vgg16"):
        build_model(ModelConfig(name="vgg61"))


def test_unknown_weights_name_lists_valid_ones() -> None:
    with pytest.raises(RunnerError, match="no weights 'IMAGENET9'.*IMAGENET1K_V1"):
        build_model(ModelConfig(name="resnet18", weights="IMAGENET9"))


def test_unavailable_torchvision_weights_name_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Offline with an empty hub cache: stop with the file to place and the override, never random weights."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(RunnerError) as info:
        build_model(ModelConfig(name="resnet18", weights="DEFAULT"))
    message = str(info.value)
    assert str(tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth") in message
    assert "model.weights=null" in message


def test_random_init_only_when_asked() -> None:
    bundle = build_model(ModelConfig(name="resnet18", weights=None))
    assert bundle.preprocess is None and bundle.categories is None


def test_target_model_and_checkpoint_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(3)
    source = TinyNet()
    path = tmp_path / "tiny.pt"
    torch.save({"state_dict": source.state_dict()}, path)
    cfg = ModelConfig(_target_="tests.conftest.TinyNet", weights=None, checkpoint=str(path))
    model = build_model(cfg).model
    x = torch.randn(1, 3, 8, 8)
    torch.testing.assert_close(model(x), source.eval()(x))


def test_safetensors_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    source = TinyNet()
    save_file(source.state_dict(), str(tmp_path / "tiny.safetensors"))
    target = TinyNet()
    load_checkpoint(target, tmp_path / "tiny.safetensors")
    assert torch.equal(target.fc.weight, source.fc.weight)


def test_missing_checkpoint_file() -> None:
    with pytest.raises(RunnerError, match="Checkpoint file not found: /nowhere/model.pt"):
        load_checkpoint(TinyNet(), "/nowhere/model.pt")


def test_mismatched_checkpoint_lists_keys(tmp_path: Path) -> None:
    state = TinyNet().state_dict()
    state.pop("fc.bias")
    state["head.weight"] = torch.zeros(1)
    state["fc.weight"] = torch.zeros(2, 2)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(RunnerError) as info:
        load_checkpoint(TinyNet(), tmp_path / "bad.pt")
    message = str(info.value)
    assert "missing keys: fc.bias" in message
    assert "unexpected keys: head.weight" in message
    assert "fc.weight (2, 2) vs model (5, 8)" in message


def test_truncated_checkpoint(tmp_path: Path) -> None:
    torch.save(TinyNet().state_dict(), tmp_path / "full.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "full.pt").read_bytes()[:200])
    with pytest.raises(RunnerError, match="Cannot read checkpoint .*cut.pt"):
        load_checkpoint(TinyNet(), tmp_path / "cut.pt")


class WritesMarker:
    """Unpickled, it writes `marker`: what a malicious checkpoint does, harmless and observable."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple:
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(RunnerError, match="evil.pt is refused: it holds more than tensors"):
        load_checkpoint(TinyNet(), tmp_path / "evil.pt")


@pytest.mark.parametrize("save", ["torch.save", "pickle.dump"])
def test_malicious_checkpoint_is_one_line_without_warnings_or_advice(tmp_path: Path, save: str) -> None:
    """A refused checkpoint never runs its code, warns nothing, and never advises weights_only=False."""
    import pickle
    import warnings

    marker, path = tmp_path / "marker", tmp_path / "evil.pt"
    if save == "torch.save":
        torch.save({"x": WritesMarker(marker)}, path)
    else:  # a plain protocol-4 pickle: torch's weights-only reader warns about the protocol before refusing
        path.write_bytes(pickle.dumps({"x": WritesMarker(marker)}, protocol=4))
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RunnerError) as info:
        warnings.simplefilter("always")
        load_checkpoint(TinyNet(), path)
    message = str(info.value)
    assert "is refused" in message and "\n" not in message
    assert "weights_only=False" not in message and "will likely succeed" not in message
    assert [str(w.message) for w in caught] == []
    assert not marker.exists()


@pytest.mark.slow
def test_malicious_checkpoint_exits_2_with_one_line(tmp_path: Path) -> None:
    import pickle

    from tests.conftest import run_cli

    marker, path = tmp_path / "marker", tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({"x": WritesMarker(marker)}, protocol=4))
    done = run_cli("debug=tiny", "model._target_=tests.conftest.TinyNet", f"model.checkpoint={path}", "hooks=[]",
                   "layers.include=[features.0]", f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert done.returncode == 2, done.stderr
    problems = [line for line in done.stderr.splitlines() if "Warning" in line or "Traceback" in line]
    assert problems == [] and "weights_only=False" not in done.stderr
    assert not marker.exists()


def _pickle_files(tmp_path: Path) -> dict[str, Path]:
    """The same marker-writing object as each loader's file: torch.save, pickle, joblib, pandas, numpy."""
    import pickle

    import joblib
    import numpy as np

    evil = WritesMarker(tmp_path / "marker")
    files = {name: tmp_path / name for name in ("evil.pt", "evil.pkl", "evil.joblib", "evil.npy")}
    torch.save({"x": evil}, files["evil.pt"])
    files["evil.pkl"].write_bytes(pickle.dumps(evil))
    joblib.dump(evil, files["evil.joblib"])
    np.save(files["evil.npy"], np.array([evil], dtype=object), allow_pickle=True)
    assert not (tmp_path / "marker").exists()
    return files


@pytest.mark.parametrize(
    ("target", "kwargs"),
    [
        ("torch.load", {"f": "evil.pt", "weights_only": False}),
        ("torch.serialization.load", {"f": "evil.pt", "weights_only": True}),  # any torch.load: checkpoint's job
        ("tests.conftest.torch.load", {"f": "evil.pt", "weights_only": False}),  # re-exported by a user module
        ("pickle.load", {"file": {"_target_": "builtins.open", "file": "evil.pkl", "mode": "rb"}}),
        ("pandas.read_pickle", {"filepath_or_buffer": "evil.pkl"}),
        ("joblib.load", {"filename": "evil.joblib"}),
        ("numpy.load", {"file": "evil.npy", "allow_pickle": True}),
        ("numpy.load", {"_args_": ["evil.npy", None, True]}),  # allow_pickle given by position
        ("torch.jit.load", {"f": "evil.pt"}),
        ("torch.hub.load_state_dict_from_url", {"url": "file:///nowhere"}),
        # nested: Hydra builds a kwarg's own `_target_` before the model
        ("torch.nn.Sequential", {"_args_": [{"_target_": "torch.load", "f": "evil.pt", "weights_only": False}]}),
    ],
)
def test_target_that_loads_pickles_is_refused_like_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, kwargs: dict
) -> None:
    monkeypatch.chdir(tmp_path)  # the files by their relative names
    _pickle_files(tmp_path)
    with pytest.raises(RunnerError, match="loads a pickle .* refused, as a checkpoint with code is"):
        build_model(ModelConfig(_target_=target, weights=None, kwargs=kwargs))
    assert not (tmp_path / "marker").exists()


def test_nested_pickle_loader_is_named_by_its_config_entry(tmp_path: Path) -> None:
    cfg = ModelConfig(_target_="tests.conftest.TinyNet", weights=None,
                      kwargs={"inner": {"_target_": "pandas.read_pickle", "filepath_or_buffer": "x.pkl"}})  # fmt: skip
    with pytest.raises(RunnerError, match=r"^model\.kwargs\.inner\._target_=pandas\.read_pickle loads a pickle"):
        build_model(cfg)


def test_numpy_load_without_pickles_is_not_refused(tmp_path: Path) -> None:
    import numpy as np

    np.save(tmp_path / "a.npy", np.zeros(3))
    with pytest.raises(
        RunnerError, match="built a ndarray, not a torch.nn.Module"
    ):  # refused as no model, not as a pickle
        build_model(ModelConfig(_target_="numpy.load", weights=None, kwargs={"file": str(tmp_path / "a.npy")}))


# ---- model sources: one registry, the source inferred when model.source is null ------------------------------------
@pytest.mark.parametrize(
    ("cfg", "source"),
    [
        (ModelConfig(), "embedded"),  # the default model
        (ModelConfig(name="vgg16"), "torchvision"),
        (ModelConfig(_target_="tests.conftest.TinyNet"), "target"),  # `_target_` wins over the default name
        (ModelConfig(name="vgg16", _target_="tests.conftest.TinyNet"), "target"),
        (ModelConfig(name="resnet18", source="torchvision"), "torchvision"),
    ],
)
def test_model_source_is_inferred_or_named(cfg: ModelConfig, source: str) -> None:
    from runner.models import model_source_of, model_sources

    assert model_source_of(cfg) is model_sources()[source]


def test_target_on_the_default_model_builds_the_target() -> None:
    bundle = build_model(ModelConfig(_target_="tests.conftest.TinyNet", weights=None))
    assert type(bundle.model) is TinyNet and bundle.categories is None


def test_unknown_model_source_lists_the_registered_ones() -> None:
    with pytest.raises(
        RunnerError, match=r"Unknown model source 'torchvison'\. Did you mean: torchvision\? Available: "
    ):
        build_model(ModelConfig(name="resnet18", source="torchvison"))


def test_a_named_source_that_ignores_target_is_refused() -> None:
    with pytest.raises(RunnerError, match=r"model\._target_ is set but model\.source=torchvision"):
        build_model(ModelConfig(name="resnet18", source="torchvision", _target_="tests.conftest.TinyNet"))


def test_a_new_source_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a timm / Hugging Face source does: subclass ModelSource, register it, set model.source."""
    from runner.models import ModelBundle, ModelSource
    from runner.options.registry import MODELS

    monkeypatch.setattr(MODELS, "_options", dict(MODELS._options))  # registered for this test only

    class TinyZoo(ModelSource):
        def build(self, cfg: ModelConfig) -> ModelBundle:
            return ModelBundle(TinyNet(), None, ["a", "b", "c", "d", "e"])

    MODELS.option(TinyZoo, name="tiny_zoo")(ModelConfig)

    bundle = build_model(ModelConfig(name="anything", source="tiny_zoo", weights=None))
    assert type(bundle.model) is TinyNet and not bundle.model.training  # frozen in eval mode by build_model
    assert all(not p.requires_grad for p in bundle.model.parameters())
    with pytest.raises(RunnerError, match="Unknown model 'anything'"):  # never claimed without model.source
        build_model(ModelConfig(name="anything", weights=None))
