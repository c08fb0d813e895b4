"""Models: real embedded weights, strict checkpoints, clear errors, never a silent random fallback."""

from __future__ import annotations

import urllib.error
from pathlib import Path

import pytest
import torch

from runner.data import standard_transform
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


def test_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple:
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(RunnerError, match="Cannot read checkpoint"):
        load_checkpoint(TinyNet(), tmp_path / "evil.pt")


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
    from runner.models import MODEL_SOURCES, model_source_of

    assert model_source_of(cfg) is MODEL_SOURCES[source]


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
    from runner.models import MODEL_SOURCES, ModelBundle, ModelSource, model_source

    monkeypatch.setattr(MODEL_SOURCES, "_entries", dict(MODEL_SOURCES._entries))  # registered for this test only

    @model_source("tiny_zoo")
    class TinyZoo(ModelSource):
        def build(self, cfg: ModelConfig) -> ModelBundle:
            return ModelBundle(TinyNet(), None, ["a", "b", "c", "d", "e"])

    bundle = build_model(ModelConfig(name="anything", source="tiny_zoo", weights=None))
    assert type(bundle.model) is TinyNet and not bundle.model.training  # frozen in eval mode by build_model
    assert all(not p.requires_grad for p in bundle.model.parameters())
    with pytest.raises(RunnerError, match="Unknown model 'anything'"):  # never claimed without model.source
        build_model(ModelConfig(name="anything", weights=None))
