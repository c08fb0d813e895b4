"""Your own model: timm and Hugging Face models by name, `_target_` and checkpoints without surprises, a `model`
column that names the model, class names from the source. Offline: weights are random or made here."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from runner.errors import RunnerError
from runner.models import build_model, model_label
from runner.models.base import Preprocess
from runner.schema import ModelConfig
from tests.conftest import TinyNet, run_cli

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

ANIMALS = {0: "cat", 1: "dog", 2: "fox"}


@pytest.fixture
def hub_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty Hugging Face cache, offline (HF_HUB_OFFLINE=1): nothing can be downloaded."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def place_in_cache(cache: Path, repo: str, file: str, state: dict[str, torch.Tensor]) -> None:
    """Write `state` where the Hub's cache layout puts `file` of `repo` at revision main."""
    from safetensors.torch import save_file

    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    save_file({k: v.contiguous() for k, v in state.items()}, str(snapshot / file))


# ---- 1. timm by name ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "kwargs"), [("convnext_tiny", {}), ("vit_tiny_patch16_224", {"img_size": 32})])
def test_timm_model_by_name_random_init(name: str, kwargs: dict) -> None:
    cfg = ModelConfig(name=name, source="timm", weights=None, kwargs=kwargs)
    bundle = build_model(cfg)
    assert type(bundle.model).__module__.startswith("timm.")
    assert bundle.model(torch.randn(2, 3, 32, 32)).shape == (2, 1000)  # (B, classes)
    assert bundle.preprocess is None and bundle.categories is None  # random init: no weights' transform or names
    assert model_label(cfg) == f"timm:{name}"


def test_timm_pretrained_offline_names_the_file_and_repo(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("HF_HUB_OFFLINE=1: nothing may be downloaded")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_download)
    with pytest.raises(RunnerError) as info:
        build_model(ModelConfig(name="resnet18", source="timm", weights="DEFAULT"))
    message = str(info.value)
    assert "timm/resnet18.a1_in1k" in message and "model.safetensors" in message
    assert str(hub_cache) in message and "model.weights=null" in message


def test_timm_pretrained_tag_from_the_cache_with_preprocessing_and_names(hub_cache: Path) -> None:
    torch.manual_seed(0)
    saved = timm.create_model("resnet18").state_dict()
    place_in_cache(hub_cache, "timm/resnet18.a1_in1k", "model.safetensors", saved)
    bundle = build_model(ModelConfig(name="resnet18", source="timm", weights="a1_in1k"))
    torch.testing.assert_close(bundle.model.state_dict()["fc.weight"], saved["fc.weight"])  # these weights, not random
    assert isinstance(bundle.preprocess, Preprocess)
    assert (bundle.preprocess.resize_size, bundle.preprocess.crop_size) == (235, 224)  # crop_pct 0.95 at 224
    from PIL import Image

    assert bundle.preprocess(Image.new("RGB", (300, 260))).shape == (3, 224, 224)  # (C, H, W)
    assert bundle.categories is not None and bundle.categories[285] == "Egyptian cat"
    assert bundle.class_names is bundle.categories


def test_timm_unknown_name_and_tag_suggest(hub_cache: Path) -> None:
    with pytest.raises(RunnerError, match=r"Unknown timm model 'convnext_tiniest'.*convnext_tiny"):
        build_model(ModelConfig(name="convnext_tiniest", source="timm", weights=None))
    with pytest.raises(RunnerError, match=r"no pretrained weights 'in9k'.*a1_in1k"):
        build_model(ModelConfig(name="resnet18", source="timm", weights="in9k"))
    with pytest.raises(RunnerError, match=r"model=timm needs model.name=NAME"):
        build_model(ModelConfig(name="", source="timm", weights=None))


def test_timm_checkpoint_replaces_the_weights_without_looking_for_them(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    def no_lookup(*args: object, **kwargs: object) -> None:
        raise AssertionError("a checkpoint replaces the pretrained weights: they are not looked for")

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", no_lookup)
    torch.manual_seed(1)
    source = timm.create_model("resnet18", num_classes=4)
    torch.save(source.state_dict(), tmp_path / "four.pt")
    cfg = ModelConfig(name="resnet18", source="timm", checkpoint=str(tmp_path / "four.pt"), kwargs={"num_classes": 4})
    bundle = build_model(cfg)  # weights: DEFAULT, as conf/model/timm.yaml says
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(bundle.model(x), source.eval()(x))
    assert bundle.categories is None  # ImageNet's names are not the checkpoint's


@pytest.mark.slow
def test_cli_timm_convnext_writes_cam_table_with_model_column(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = run_cli("experiment=gradcam_effnet", "model=timm", "model.name=convnext_tiny", "model.weights=null",
                   "layers.include=[ConvNeXtBlock]", "debug=tiny", "method.faithfulness.enabled=false",
                   f"hydra.run.dir={out}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    cam = pd.read_parquet(out / "cam.parquet")
    assert set(cam["model"]) == {"timm:convnext_tiny"}
    assert cam["layer"].nunique() == 18  # convnext_tiny's ConvNeXt blocks: 3 + 3 + 9 + 3


# ---- 2. Hugging Face image classifiers ------------------------------------------------------------------------------
@pytest.fixture
def hf_convnext(tmp_path: Path) -> Path:
    """A tiny random ConvNext classifier with its image processor, saved as save_pretrained does."""
    folder = tmp_path / "tiny-convnext"
    config = transformers.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3, image_size=32,
        id2label=ANIMALS, label2id={v: k for k, v in ANIMALS.items()},
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.ConvNextForImageClassification(config).save_pretrained(folder)
    transformers.ConvNextImageProcessor(size={"shortest_edge": 32}).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_hf_folder_builds_a_logits_model_with_preprocessing_and_id2label(hf_convnext: Path, hub_cache: Path) -> None:
    from PIL import Image

    cfg = ModelConfig(name=str(hf_convnext), source="hf")
    bundle = build_model(cfg)
    logits = bundle.model(torch.randn(2, 3, 32, 32))
    assert torch.is_tensor(logits) and logits.shape == (2, 3)  # (B, num_labels): the tensor, not an output object
    assert bundle.categories == ["cat", "dog", "fox"]
    assert "convnext.encoder.stages.1" in dict(bundle.model.named_modules())  # the model's own layer names
    assert bundle.preprocess is not None and bundle.preprocess(Image.new("RGB", (64, 48))).shape == (3, 32, 32)
    assert model_label(cfg) == f"hf:{hf_convnext}"
    saved = transformers.ConvNextForImageClassification.from_pretrained(hf_convnext).eval()
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(bundle.model(x), saved(x).logits)  # the saved weights


def test_hf_missing_hub_id_offline_is_one_clear_error(hub_cache: Path) -> None:
    with pytest.raises(RunnerError) as info:
        build_model(ModelConfig(name="someone/no-such-model", source="hf"))
    message = str(info.value)
    assert "'someone/no-such-model' is neither a local folder nor in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE=1" in message and str(hub_cache) in message


@pytest.mark.slow
def test_cli_hf_folder_run(hf_convnext: Path, tmp_path: Path, hub_cache: Path) -> None:
    out = tmp_path / "run"
    done = run_cli("model=hf", f"model.name={hf_convnext}", "layers.include=[ConvNextStage]", "debug=tiny",
                   "hooks=[]", f"hydra.run.dir={out}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    cam = pd.read_parquet(out / "cam.parquet")
    assert set(cam["model"]) == {f"hf:{hf_convnext}"}
    assert set(cam["layer"]) == {"convnext.encoder.stages.0", "convnext.encoder.stages.1"}
    assert set(cam["predicted_name"]) <= set(ANIMALS.values()) and cam["predicted_name"].notna().all()


# ---- 3. `_target_` and `checkpoint` just work ------------------------------------------------------------------------
@pytest.mark.parametrize("weights", ["DEFAULT", "embedded", None])
def test_target_ignores_the_model_yamls_default_weights(weights: str | None) -> None:
    bundle = build_model(ModelConfig(_target_="tests.conftest.TinyNet", weights=weights))
    assert type(bundle.model) is TinyNet


def test_target_with_other_weights_says_to_use_a_checkpoint() -> None:
    with pytest.raises(RunnerError, match=r"model.weights=IMAGENET1K_V1 does not apply to a `_target_`.*checkpoint"):
        build_model(ModelConfig(_target_="tests.conftest.TinyNet", weights="IMAGENET1K_V1"))


def test_target_module_in_the_working_directory_is_importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_cwd_net.py").write_text("from tests.conftest import TinyNet as Net\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])  # as `runner` has it
    monkeypatch.delitem(sys.modules, "my_cwd_net", raising=False)
    bundle = build_model(ModelConfig(_target_="my_cwd_net.Net"))
    assert type(bundle.model) is TinyNet


def test_target_that_cannot_be_imported_says_how_to_fix_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunnerError) as info:
        build_model(ModelConfig(_target_="nowhere_pkg.models.Net"))
    message = str(info.value)
    assert "Cannot import `nowhere_pkg`" in message and "PYTHONPATH" in message and "pip install -e" in message
    assert "\n" not in message
    (tmp_path / "needs_missing.py").write_text("import not_installed_pkg_xyz\n")
    with pytest.raises(RunnerError, match=r"Importing `needs_missing`.*No module named 'not_installed_pkg_xyz'"):
        build_model(ModelConfig(_target_="needs_missing.Net"))


def test_torchvision_checkpoint_does_not_download_imagenet_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchvision

    def offline(*args: object, **kwargs: object) -> None:
        raise AssertionError("a checkpoint replaces every weight: nothing is downloaded")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    torch.manual_seed(2)
    source = torchvision.models.resnet18(num_classes=4)
    torch.save(source.state_dict(), tmp_path / "four.pt")
    bundle = build_model(
        ModelConfig(name="resnet18", weights="DEFAULT", checkpoint=str(tmp_path / "four.pt"), kwargs={"num_classes": 4})
    )
    torch.testing.assert_close(bundle.model.fc.weight, source.fc.weight)
    assert bundle.categories is None


def test_checkpoint_with_another_head_says_its_num_classes(tmp_path: Path) -> None:
    import torchvision

    torch.save(torchvision.models.resnet18(num_classes=4).state_dict(), tmp_path / "four.pt")
    with pytest.raises(RunnerError) as info:
        build_model(ModelConfig(name="resnet18", weights=None, checkpoint=str(tmp_path / "four.pt")))
    message = str(info.value)
    assert "fc.weight (4, 512) vs model (1000, 512)" in message
    assert "(fc.weight) has 4 classes" in message and "+model.kwargs.num_classes=4" in message


# ---- 4. the `model` column names the model ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cfg", "label"),
    [
        (ModelConfig(), "embedded:efficientnet_lite0"),
        (ModelConfig(name="vgg16"), "torchvision:vgg16"),
        (ModelConfig(name="convnext_tiny", source="timm"), "timm:convnext_tiny"),
        (ModelConfig(name="org/vit-x", source="hf"), "hf:org/vit-x"),
        (ModelConfig(_target_="tests.conftest.TinyNet"), "target:tests.conftest.TinyNet"),
        (
            ModelConfig(_target_="timm.create_model", kwargs={"model_name": "resnet18"}),
            "target:timm.create_model:resnet18",
        ),
    ],
)
def test_model_label_names_source_and_model(cfg: ModelConfig, label: str) -> None:
    assert model_label(cfg) == label


def test_run_columns_model_is_the_label() -> None:
    from runner.ids import run_columns
    from tests.conftest import make_config

    assert run_columns(make_config("model=vgg16"), "r")["model"] == "torchvision:vgg16"


# ---- 5. class names --------------------------------------------------------------------------------------------------
def test_model_class_names_replace_the_sources_and_must_fit() -> None:
    cfg = ModelConfig(_target_="tests.conftest.TinyNet", class_names=["a", "b", "c", "d", "e"])
    assert build_model(cfg).class_names == ["a", "b", "c", "d", "e"]
    with pytest.raises(RunnerError, match=r"model.class_names has 2 names but the model's last Linear layer has 5"):
        build_model(ModelConfig(_target_="tests.conftest.TinyNet", class_names=["a", "b"]))


def test_model_class_names_from_the_command_line() -> None:
    from tests.conftest import make_config

    assert make_config("model.class_names=[tabby,tiger]").model.class_names == ["tabby", "tiger"]


# ---- 5. each command of docs/models.md in one command: no hooks=[], the model's own input size ---------------------
NET = """import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
                                  nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))
"""


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    """Two class folders of one photo each, neither square (as a user's photos are)."""
    from PIL import Image

    root = tmp_path / "photos"
    for label, size in (("cats", (80, 50)), ("dogs", (40, 60))):
        (root / label).mkdir(parents=True)
        Image.new("RGB", size, (200, 120, 40)).save(root / label / "a.png")
    return root


@pytest.fixture
def hf_vit64(tmp_path: Path) -> Path:
    """A tiny random ViT classifier whose image processor makes 64 px inputs (the model refuses any other size)."""
    folder = tmp_path / "my-finetuned-vit"
    config = transformers.ViTConfig(
        image_size=64, patch_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        num_labels=3, id2label=ANIMALS, label2id={v: k for k, v in ANIMALS.items()},
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": 64, "width": 64}).save_pretrained(folder)
    return folder


def cam_of(out: Path, done: object) -> pd.DataFrame:
    assert done.returncode == 0, done.stderr[-3000:]  # type: ignore[attr-defined]
    return pd.read_parquet(out / "cam.parquet")


@pytest.mark.slow
@pytest.mark.parametrize("data", [["data=image_folder"], [], ["data=synthetic"]])
@pytest.mark.parametrize("layers", [[], ["layers.include=[ViTLayer]"]])
def test_hf_model_takes_its_processors_size_from_every_data_source(
    hf_vit64: Path, photos: Path, hub_cache: Path, tmp_path: Path, data: list[str], layers: list[str]
) -> None:
    """debug=tiny says 32 px, the processor 64: the photos (any resize mode), composites and synthetic tensors are
    made at 64; the ViT's two layers are the auto choice too; the default experiment's hooks are not inherited."""
    out = tmp_path / "run"
    root = [f"data.root={photos}"] if data == ["data=image_folder"] else []
    done = run_cli("model=hf", f"model.name={hf_vit64}", *data, *root, *layers, "debug=tiny", f"hydra.run.dir={out}")
    cam = cam_of(out, done)
    assert set(cam["layer"]) == {"vit.layers.0", "vit.layers.1"}
    assert set(cam["map_height"]) == {4} and set(cam["map_width"]) == {4}  # 64 px / 16 px patches
    assert not (out / "hooks.parquet").exists()
    assert "inputs: 64x64, the model's own size" in done.stdout + done.stderr


@pytest.mark.slow
def test_a_size_the_model_refuses_is_one_message_before_the_run(hf_vit64: Path, photos: Path, tmp_path: Path) -> None:
    """data.resize=none keeps each photo's aspect ratio: the 64 px ViT refuses it; timm's ViT at 32 px too."""
    for args in (
        ["model=hf", f"model.name={hf_vit64}", "data=image_folder", f"data.root={photos}", "data.resize=none"],
        ["model=timm", "model.name=vit_tiny_patch16_224", "model.weights=null"],
    ):
        done = run_cli(*args, "debug=tiny", f"hydra.run.dir={tmp_path / args[1][-8:]}")
        assert done.returncode == 2, done.stderr[-3000:]
        assert "The model cannot take inputs of shape [3, " in done.stderr and "Traceback" not in done.stderr
        assert not (tmp_path / args[1][-8:] / "cam.parquet").exists()


@pytest.mark.slow
def test_readme_timm_layers_listing_marks_the_auto_choice() -> None:
    done = run_cli("layers", "model=timm", "model.name=vit_tiny_patch16_224", "model.weights=null", "--grep",
                   r"blocks\.[0-9]+$")  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[1:-1]]
    assert len(rows) == 12 and [r[2] for r in rows if r[1] == "*"] == ["blocks.2", "blocks.5", "blocks.8", "blocks.11"]
    assert "4 selected (*)" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layers", [[], ["layers.include=[ConvNeXtStage]"]])
def test_readme_timm_model_runs_in_one_command(tmp_path: Path, layers: list[str]) -> None:
    out = tmp_path / "run"
    done = run_cli("experiment=gradcam_effnet", "model=timm", "model.name=convnext_tiny", "model.weights=null",
                   *layers, "debug=tiny", "data.image_size=64", "method.faithfulness.enabled=false",
                   f"hydra.run.dir={out}")  # fmt: skip
    assert set(cam_of(out, done)["layer"]) == {"stages.0", "stages.1", "stages.2", "stages.3"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["model=timm", "model.name=convnext_tiny", "model.weights=fb_in1k"],
        ["model=hf", "model.name=facebook/convnext-tiny-224", "layers.include=[ConvNextStage]"],
    ],
)
def test_readme_hub_models_offline_are_one_line(hub_cache: Path, tmp_path: Path, args: list[str]) -> None:
    done = run_cli(*args, "debug=tiny", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "Hugging Face cache" in done.stderr and "HF_HUB_OFFLINE=1" in done.stderr


@pytest.mark.slow
def test_readme_target_with_checkpoint_runs_in_one_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`model._target_=my_net.Net` from the working directory, with its checkpoint: the layers are auto's."""
    (tmp_path / "my_net.py").write_text(NET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_net", raising=False)
    import my_net  # type: ignore[import-not-found]

    torch.save(my_net.Net(classes=4).state_dict(), tmp_path / "net.pt")
    out = tmp_path / "run"
    done = run_cli("model._target_=my_net.Net", "+model.kwargs.classes=4", "model.checkpoint=net.pt", "debug=tiny",
                   f"hydra.run.dir={out}")  # fmt: skip
    cam = cam_of(out, done)
    assert set(cam["layer"]) == {"body.0", "body.2", "body.4"} and set(cam["model"]) == {"target:my_net.Net"}


@pytest.mark.slow
def test_readme_torchvision_checkpoint_runs_in_one_command(tmp_path: Path) -> None:
    import torchvision

    torch.save(torchvision.models.resnet18(num_classes=4).state_dict(), tmp_path / "x.pt")
    out = tmp_path / "run"
    done = run_cli("model=resnet18", "+model.kwargs.num_classes=4", f"model.checkpoint={tmp_path / 'x.pt'}",
                   "model.class_names=[a,b,c,d]", "debug=tiny", f"hydra.run.dir={out}")  # fmt: skip
    cam = cam_of(out, done)
    assert set(cam["layer"]) == {"layer1.1", "layer2.0", "layer3.0", "layer3.1"}  # layer4 is 1x1 at 32 px
    assert set(cam["predicted_name"]) <= {"a", "b", "c", "d"}


@pytest.mark.slow
def test_composites_with_an_image_processor_ask_for_the_runners_geometry(hf_vit64: Path, tmp_path: Path) -> None:
    """An image processor's size ("64x64") does not say how masks follow its resize: one line naming the fix, exit 2,
    and the fix (data.resize=pad: the runner's geometry at the processor's size) runs with masks on the photos."""
    base = ["model=hf", f"model.name={hf_vit64}", "data=composites", "debug=tiny"]
    refused = run_cli(*base, f"hydra.run.dir={tmp_path / 'square'}")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "Localisation masks need the input geometry" in refused.stderr and "data.resize=pad" in refused.stderr
    cam = cam_of(tmp_path / "pad", run_cli(*base, "data.resize=pad", f"hydra.run.dir={tmp_path / 'pad'}"))
    assert set(cam["map_height"]) == {4}  # 64 px inputs, the processor's size


def test_the_lm_log_line_names_the_models_own_type_and_the_layout_it_runs_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Qwen2 model runs through Llama's layout: the line says `qwen2 (llama's layout)`, not `llama`."""
    import logging

    from tests.conftest import make_config
    from tests.lm_references import build_tiny_lm

    _, _, folder = build_tiny_lm("qwen2", seed=0, folder=tmp_path)
    with caplog.at_level(logging.INFO, logger="runner.models"):
        build_model(make_config("model=hf_lm", f"model.name={folder}").model)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"model {folder}: ")]
    assert len(lines) == 1 and lines[0].startswith(f"model {folder}: qwen2 (llama's layout), 2 layers"), lines


def test_a_folders_tokenizer_loads_once_a_process_until_its_files_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second load of a folder's tokenizer reads nothing; each caller gets its own copy (its settings its own);
    a file of the folder rewritten is loaded again."""
    import shutil

    from runner.models import hf_lm

    folder = tmp_path / "lm"
    shutil.copytree(hf_lm.shipped_folder(), folder)
    loads = []
    original = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: loads.append(a) or original(*a, **k)
    )
    first = hf_lm.load_tokenizer(transformers, str(folder))
    second = hf_lm.load_tokenizer(transformers, str(folder))
    assert len(loads) == 1 and first is not second
    side = first.padding_side
    second.padding_side = "right" if side == "left" else "left"
    assert first.padding_side == side
    assert first("a b a")["input_ids"] == second("a b a")["input_ids"] == original(str(folder))("a b a")["input_ids"]
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"model_max_length": 64', '"model_max_length": 7'))
    third = hf_lm.load_tokenizer(transformers, str(folder))
    assert len(loads) == 2 and third.model_max_length == 7


def test_finite_weights_are_told_from_nan_and_infinity_and_an_overflowing_sum() -> None:
    from runner.models.hf_lm import _finite

    def model(*values: float, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        net = torch.nn.Linear(len(values), 1, bias=False)
        net.weight.data = torch.tensor([values], dtype=dtype)
        return net

    assert _finite(model(1.0, -2.0))
    assert not _finite(model(1.0, float("nan")))
    assert not _finite(model(float("inf"), float("-inf")))
    assert _finite(model(60000.0, 60000.0, dtype=torch.float16))  # the sum overflows; every value is finite
    assert not _finite(model(60000.0, float("inf"), dtype=torch.float16))
