"""Data sources: the real scikit-image photos, image folders, seeded synthetic tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.data import ImageFolderConfig, SkimagePhotosConfig, SyntheticConfig, build_dataset
from runner.errors import RunnerError


def test_skimage_photos_are_real_images_with_labels() -> None:
    dataset = build_dataset(SkimagePhotosConfig(photos=["chelsea", "coffee", "astronaut"], image_size=64), None, 0)
    samples = [dataset[i] for i in range(len(dataset))]
    assert [s[2] for s in samples] == ["chelsea", "coffee", "astronaut"]
    assert [s[1] for s in samples] == [285, 967, -1]
    assert all(s[0].shape == (3, 64, 64) for s in samples)
    assert not torch.allclose(samples[0][0], samples[1][0])


def test_unknown_photo_is_a_clear_error() -> None:
    with pytest.raises(RunnerError, match="no photo 'chelsee'.*chelsea"):
        build_dataset(SkimagePhotosConfig(photos=["chelsee"]), None, 0)


def write_image(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((10, 12, 3), value, dtype=np.uint8)).save(path)


def test_image_folder_with_class_subfolders(tmp_path: Path) -> None:
    write_image(tmp_path / "dog" / "a.png", 10)
    write_image(tmp_path / "cat" / "b.jpg", 200)
    dataset = build_dataset(ImageFolderConfig(root=str(tmp_path), image_size=16), None, 0)
    assert [(dataset[i][2], dataset[i][1]) for i in range(2)] == [("cat/b.jpg", 0), ("dog/a.png", 1)]


def test_flat_image_folder_has_no_labels(tmp_path: Path) -> None:
    write_image(tmp_path / "a.png", 10)
    dataset = build_dataset(ImageFolderConfig(root=str(tmp_path), image_size=16), None, 0)
    assert dataset[0][1] == -1 and dataset[0][0].shape == (3, 16, 16)


def test_empty_and_missing_folders_fail_clearly(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(RunnerError, match="contains no images"):
        build_dataset(ImageFolderConfig(root=str(tmp_path)), None, 0)
    with pytest.raises(RunnerError, match="Image folder not found"):
        build_dataset(ImageFolderConfig(root=str(tmp_path / "missing")), None, 0)


def test_corrupt_images_are_skipped_and_named_or_fail_when_strict(tmp_path: Path) -> None:
    from runner.data import skipped_files

    write_image(tmp_path / "good.png", 10)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    truncated = tmp_path / "truncated.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:2000])  # a real header and half the pixels
    dataset = build_dataset(ImageFolderConfig(root=str(tmp_path)), None, 0)
    assert [dataset[i][2] for i in range(len(dataset))] == ["good.png"]
    assert sorted(Path(p).name for p in skipped_files(dataset)) == ["broken.png", "truncated.png"]
    with pytest.raises(RunnerError, match="2 unreadable or corrupt image file.*broken.png, truncated.png.*data.strict"):
        build_dataset(ImageFolderConfig(root=str(tmp_path), strict=True), None, 0)


def test_synthetic_is_seeded_and_limit_applies() -> None:
    cfg = SyntheticConfig(shape=[3, 8, 8], count=5, num_classes=10, limit=3)
    a, b, c = build_dataset(cfg, None, 0), build_dataset(cfg, None, 0), build_dataset(cfg, None, 1)
    assert len(a) == 3
    assert torch.equal(a[2][0], b[2][0]) and a[2][1] == b[2][1]
    assert not torch.equal(a[2][0], c[2][0])
