"""Class names in every table: `label_name` from the data set (class folders, `data.class_names`, else the model's
where labels are its classes), `predicted_name` and `target_name` from the model's, and targets by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

import runner.app as app
from runner.data.base import build_dataset, label_classes
from runner.errors import RunnerError
from runner.options.data.image_folder import ImageFolderConfig
from runner.options.registry import POINTS
from runner.tables import declared, full_schema
from tests.conftest import make_config

MODEL_NAMES = ["ant", "bee", "cat", "dog", "eel"]  # TinyNet's 5 outputs
TINY = [
    "model._target_=tests.conftest.TinyNet",
    "model.weights=null",
    f"model.class_names=[{','.join(MODEL_NAMES)}]",
    "layers.include=[features.2]",
    "hooks=[]",
    "data.batch_size=2",
]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A class-per-folder data set: kitten/ (2 images) and puppy/ (1), tiny PNGs of different colours."""
    root = tmp_path / "images"
    for i, (cls, value) in enumerate([("kitten", 30), ("kitten", 120), ("puppy", 220)]):
        (root / cls).mkdir(parents=True, exist_ok=True)
        pixels = np.full((12, 10, 3), value, dtype=np.uint8)
        pixels[::2, ::3] = 255 - value  # some structure, so that the model's outputs differ between images
        Image.fromarray(pixels).save(root / cls / f"{i}.png")
    return root


def run_table(tmp_path: Path, table: str, *overrides: str) -> pd.DataFrame:
    result = app.run(make_config(*TINY, *overrides), tmp_path / "out")
    return pd.read_parquet(result.tables[table])


def folder_run(tmp_path: Path, folder: Path, *overrides: str) -> pd.DataFrame:
    return run_table(tmp_path, "cam", "data=image_folder", f"data.root={folder}", "data.image_size=32", *overrides)


# ---- 1. label_name ------------------------------------------------------------------------------------------------
def test_label_name_is_the_class_folder_and_predicted_name_the_models(tmp_path: Path, folder: Path) -> None:
    cam = folder_run(tmp_path, folder, "method=gradcam")
    assert len(cam) == 3
    assert dict(zip(cam["sample_id"], cam["label_name"], strict=True)) == {
        "kitten/0.png": "kitten", "kitten/1.png": "kitten", "puppy/2.png": "puppy",
    }  # fmt: skip
    assert list(cam["label"]) == [0, 0, 1]
    assert list(cam["predicted_name"]) == [MODEL_NAMES[p] for p in cam["predicted"]]  # the model's, not the folders'
    assert list(cam["target_name"]) == [MODEL_NAMES[t] for t in cam["target"]]


def test_data_class_names_replace_the_folder_names(tmp_path: Path, folder: Path) -> None:
    cam = folder_run(tmp_path, folder, "method=gradcam", "data.class_names=[Felis,Canis]")
    assert list(cam["label_name"]) == ["Felis", "Felis", "Canis"]


def test_data_class_names_of_another_length_than_the_folders_fail(tmp_path: Path, folder: Path) -> None:
    with pytest.raises(
        RunnerError, match=r"data.class_names has 3 names but the data set has 2 classes \(kitten, puppy"
    ):
        folder_run(tmp_path, folder, "method=gradcam", "data.class_names=[a,b,c]")


def test_labels_that_are_the_models_classes_take_its_names(tmp_path: Path) -> None:
    synthetic = ["data=synthetic", "data.shape=[3,16,16]", "data.count=4", "data.num_classes=5", "method=gradcam"]
    cam = run_table(tmp_path, "cam", *synthetic)
    assert cam["label"].notna().all()
    assert list(cam["label_name"]) == [MODEL_NAMES[y] for y in cam["label"]]


def test_the_photos_imagenet_labels_take_the_pretrained_models_names(tmp_path: Path) -> None:
    overrides = ["data.photos=[chelsea,astronaut]", "data.image_size=64", "layers.include=[_conv_head]", "hooks=[]"]
    cam = pd.read_parquet(app.run(make_config(*overrides), tmp_path / "out").tables["cam"]).set_index("sample_id")
    assert cam.loc["chelsea", "label_name"] == "Egyptian cat"
    assert pd.isna(cam.loc["astronaut", "label"]) and pd.isna(cam.loc["astronaut", "label_name"])  # no label


def test_label_name_is_null_without_names(tmp_path: Path, folder: Path) -> None:
    flat = folder / "kitten"  # no class folders: no labels, no names
    config = make_config(*TINY[:2], *TINY[3:], "method=gradcam", "data=image_folder", f"data.root={flat}",
                         "data.image_size=32")  # fmt: skip
    cam = pd.read_parquet(app.run(config, tmp_path / "out").tables["cam"])
    assert cam["label"].isna().all() and cam["label_name"].isna().all()
    assert cam["predicted_name"].isna().all() and cam["target_name"].isna().all()  # no model.class_names either


def test_label_classes_of_folders(folder: Path) -> None:
    assert label_classes(build_dataset(ImageFolderConfig(root=str(folder), image_size=16), None, 0)) == (
        ["kitten", "puppy"], False,
    )  # fmt: skip
    flat = build_dataset(ImageFolderConfig(root=str(folder / "kitten"), image_size=16), None, 0)
    assert label_classes(flat) == (None, False)


# ---- 2. target_name -----------------------------------------------------------------------------------------------
def test_every_table_with_a_target_declares_target_name_after_it() -> None:
    for option in POINTS["method"]:  # a method's tables are declared when its module loads: every one, run alone too
        option.load()
    with_target = {t for t, s in declared().items() if "target" in s.names}
    assert with_target >= {"cam", "patching", "sanity"}
    for table in with_target:
        names = full_schema(table).names
        assert names[names.index("target") + 1] == "target_name", table
    assert "label_name" in full_schema("hooks").names  # beside `label` in every table


def test_patching_rows_name_their_target(tmp_path: Path) -> None:
    synthetic = ["data=synthetic", "data.shape=[3,16,16]", "data.count=2", "data.num_classes=5"]
    rows = run_table(tmp_path, "patching", *synthetic, "method=patching", "method.patching.grid=[2,2]")
    assert len(rows) > 0
    assert list(rows["target_name"]) == [MODEL_NAMES[t] for t in rows["target"]]


# ---- 3. targets by name -------------------------------------------------------------------------------------------
def test_targets_by_name_pick_the_models_class(tmp_path: Path, folder: Path) -> None:
    cam = folder_run(tmp_path, folder, "method=gradcam", "method.class_names=[dog]")
    assert set(cam["target"]) == {3} and set(cam["target_name"]) == {"dog"}


def test_targets_by_name_one_per_sample(tmp_path: Path, folder: Path) -> None:
    cam = folder_run(tmp_path, folder, "method=gradcam", "method.class_names=[eel,Bee,ant]")  # case-insensitive
    assert list(cam["target"]) == [4, 1, 0] and list(cam["target_name"]) == ["eel", "bee", "ant"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method.class_names=[dgo]"], r"the model has no class 'dgo'\. Did you mean: dog\?"),
        (["method.class_names=[dog]", "method.class_ids=[1]"], "method.class_names or method.class_ids, not both"),
        (["method.class_names=[dog]", "method.target=topk"], "does not combine with method.target=topk"),
        (["method.class_names=[dog,cat]"], r"has 2 ids but the data set has 3 samples"),
        (["method.class_names=[dog]", "model.class_names=[ant,dog,cat,dog,eel]"], r"'dog' names 2 .*ids \[1, 3\]"),
    ],
)
def test_targets_by_name_errors(tmp_path: Path, folder: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(RunnerError, match=message):
        folder_run(tmp_path, folder, "method=gradcam", *overrides)


def test_targets_by_name_without_model_names_say_to_set_them(tmp_path: Path, folder: Path) -> None:
    config = make_config(*TINY[:2], *TINY[3:], "method=gradcam", "method.class_names=[dog]", "data=image_folder",
                         f"data.root={folder}", "data.image_size=32")  # fmt: skip
    with pytest.raises(RunnerError, match=r"needs the model's class names.*set model\.class_names=\[\.\.\.\]"):
        app.run(config, tmp_path / "out")
