"""Data sources: the real scikit-image photos, image folders, seeded synthetic tensors."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.data.base import build_dataset, make_loader
from runner.data.images import pil_to_rgb
from runner.errors import RunnerError
from runner.options.data.image_folder import ImageFolderConfig
from runner.options.data.skimage_photos import SkimagePhotosConfig
from runner.options.data.synthetic import SyntheticConfig
from tests.conftest import make_config


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
    from runner.data.base import skipped_files

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


# ---- EXIF orientation: photos (and their masks) as a viewer shows them ---------------------------------------------
# The transpose that stores an upright picture under each EXIF orientation (exif_transpose undoes it).
STORED_AS = {
    1: None, 2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}  # fmt: skip


def upright_picture() -> Image.Image:
    """30 x 20 px, no symmetry: a bright block at the top left, a dim one at the bottom right, the rest dark."""
    array = np.zeros((20, 30, 3), dtype=np.uint8)
    array[2:8, 3:12] = 250
    array[14:18, 22:28] = 120
    return Image.fromarray(array)


def save_oriented(picture: Image.Image, path: Path, orientation: int, **options: object) -> None:
    """Store `picture` as a camera would with EXIF `orientation`: the pixels turned, the tag saying how to undo it."""
    stored = picture if STORED_AS[orientation] is None else picture.transpose(STORED_AS[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(path, exif=exif, **options)


def test_exif_orientation_is_applied_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from runner.data.images import standard_transform
    from runner.schema import ResizeMode

    picture = upright_picture()
    for orientation in STORED_AS:
        save_oriented(picture, tmp_path / f"o{orientation}.png", orientation)
    with caplog.at_level("INFO", logger="runner.data"):
        dataset = build_dataset(ImageFolderConfig(root=str(tmp_path), image_size=20, resize=ResizeMode.none), None, 0)
    expected = standard_transform(20, ResizeMode.none)(picture)  # (3, 20, 30)
    for i in range(len(dataset)):
        x, _, sample_id = dataset[i]
        assert torch.equal(x, expected), sample_id  # every copy is fed upright, pixel for pixel
    lines = [r.getMessage() for r in caplog.records if "EXIF orientation" in r.getMessage()]
    assert lines == ["images: 7 of 8 carry an EXIF orientation and are turned upright as a viewer shows them (their"
                     " masks with them)"]  # fmt: skip


def test_exif_orientation_of_a_jpeg_photo(tmp_path: Path) -> None:
    """A real photo stored sideways (orientation 6, as phones do) is read like the upright one."""
    import skimage.data

    photo = Image.fromarray(skimage.data.chelsea())
    photo.save(tmp_path / "upright.jpg", quality=95)
    save_oriented(photo, tmp_path / "sideways.jpg", 6, quality=95)
    dataset = build_dataset(ImageFolderConfig(root=str(tmp_path), image_size=64), None, 0)
    sideways, upright = (dataset[i][0] for i in range(2))
    assert sideways.shape == upright.shape == (3, 64, 64)
    assert float((sideways - upright).abs().mean()) < 0.02  # JPEG re-encoding only; sideways it would be ~0.8


@pytest.mark.parametrize("side_file", ["masks.json", "mask.png"])
@pytest.mark.parametrize("orientation", list(STORED_AS))
def test_masks_follow_their_photo_s_orientation(tmp_path: Path, orientation: int, side_file: str) -> None:
    """Side files are in the stored pixels; the mask is turned with its photo, onto the same part of the scene."""
    import json

    from runner.data.base import sample_masks
    from runner.data.images import standard_transform
    from runner.schema import ResizeMode

    picture = upright_picture()
    save_oriented(picture, tmp_path / "p.png", orientation)
    with Image.open(tmp_path / "p.png") as stored:  # the bright block where the stored pixels have it
        rows, cols = np.nonzero(np.asarray(stored)[..., 0] == 250)
        region = np.zeros((stored.height, stored.width), dtype=np.uint8)
    region[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1] = 255
    if side_file == "masks.json":
        box = [int(cols.min()), int(rows.min()), int(cols.max()) + 1, int(rows.max()) + 1]
        (tmp_path / "masks.json").write_text(json.dumps({"p.png": {"boxes": [box]}}))
    else:
        Image.fromarray(region).save(tmp_path / "p.mask.png")
    dataset = build_dataset(ImageFolderConfig(root=str(tmp_path), image_size=20, resize=ResizeMode.none), None, 0)
    x = dataset[0][0]  # (3, 20, 30)
    assert torch.equal(x, standard_transform(20, ResizeMode.none)(picture))  # upright
    mask = sample_masks(dataset)("p.png")
    assert mask.shape == x.shape[1:]
    assert torch.equal(mask, x[0] > 1.5)  # exactly the bright block's pixels (normalised 250 is ~2.2)


def test_masks_follow_a_turned_jpeg_decoded_at_reduced_scale(tmp_path: Path) -> None:
    """A big sideways JPEG decoded at 1/8 scale: its stored-pixel box still lands on the block it marks."""
    import json

    from runner.data.base import sample_masks
    from runner.data.images import read_photo
    from runner.schema import ResizeMode

    picture = upright_picture().resize((1500, 1000), Image.Resampling.NEAREST)  # block at x 150..600, y 100..400
    save_oriented(picture, tmp_path / "p.jpg", 6, quality=95)
    with Image.open(tmp_path / "p.jpg") as stored:  # sideways: turned 90 degrees counter-clockwise, 1000 x 1500
        assert stored.size == (1000, 1500) and np.asarray(stored)[1000, 200, 0] > 200  # the block at x 100..400
    (tmp_path / "masks.json").write_text(json.dumps({"p.jpg": {"boxes": [[100, 900, 400, 1350]]}}))
    assert read_photo(tmp_path / "p.jpg", 40).size == (188, 125)  # 1/8 scale, upright
    dataset = build_dataset(ImageFolderConfig(root=str(tmp_path), image_size=40, resize=ResizeMode.pad), None, 0)
    x, mask = dataset[0][0], sample_masks(dataset)("p.jpg")
    bright = x[0] > 0  # at least half covered by the block: normalised dark is -2.1, the block 2.2
    assert mask.shape == bright.shape == (40, 40)
    assert float((mask & bright).sum() / (mask | bright).sum()) > 0.9


# ---- big photos: resized before they become float tensors -----------------------------------------------------------
def test_letterbox_resizes_before_the_float_tensor_within_one_level() -> None:
    """data.resize=pad scales the PIL image, then normalises and pads: within one 8-bit level of scaling the
    normalised float tensor (the same photo's geometry, the bands exactly 0)."""
    import torchvision.transforms as T

    from runner.data.images import IMAGENET_MEAN, IMAGENET_STD, Letterbox, _skimage_photo, _to_rgb, standard_transform
    from runner.schema import ResizeMode

    level = 1 / 255 / min(IMAGENET_STD)  # one 8-bit level, normalised
    for name in ("chelsea", "coffee", "page"):
        photo = _to_rgb(_skimage_photo(name))
        for size in (32, 224):
            in_float = T.Compose([T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD), Letterbox(size)])(photo)
            got = standard_transform(size, ResizeMode.pad)(photo)
            assert got.shape == in_float.shape == (3, size, size)
            assert float((got - in_float).abs().max()) <= level, (name, size)
            assert torch.equal(got == 0, in_float == 0)  # the same bands


def test_big_jpeg_decodes_near_the_needed_size_within_tolerance(tmp_path: Path) -> None:
    """A 2400 x 1800 JPEG of nine real photos at 224 px: decoded at 1/2 scale (still >= 3 x 224 px a side), its
    input within 6 levels of a full decode everywhere (at the tiles' sharp edges) and 0.25 of a level on average."""
    from runner.data.images import IMAGENET_STD, _skimage_photo, _to_rgb, read_photo, standard_transform
    from runner.schema import ResizeMode

    names = ["chelsea", "coffee", "rocket", "astronaut", "motorcycle", "horse", "camera", "hubble_deep_field", "page"]
    mosaic = Image.new("RGB", (2400, 1800))
    for i, name in enumerate(names):
        mosaic.paste(_to_rgb(_skimage_photo(name)).resize((800, 600)), ((i % 3) * 800, (i // 3) * 600))
    mosaic.save(tmp_path / "big.jpg", quality=92)
    assert read_photo(tmp_path / "big.jpg", 224).size == (1200, 900)
    level = 1 / 255 / min(IMAGENET_STD)
    for resize in (ResizeMode.pad, ResizeMode.square, ResizeMode.crop):
        transform = standard_transform(224, resize)
        with Image.open(tmp_path / "big.jpg") as im:
            full = transform(im.convert("RGB"))
        difference = (transform(read_photo(tmp_path / "big.jpg", 224)) - full).abs()
        assert float(difference.max()) < 6 * level and float(difference.mean()) < 0.25 * level, resize


BIG_PHOTO_PEAK = """
import sys
from runner.data.base import build_dataset
from runner.options.data.image_folder import ImageFolderConfig
from runner.schema import ResizeMode

def resident_mb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

small = build_dataset(ImageFolderConfig(root=sys.argv[1], image_size=224, resize=ResizeMode(sys.argv[3])), None, 0)
small[0]  # every lazy import and buffer of the path, at a small size
open("/proc/self/clear_refs", "w").write("5")  # Linux: the peak resident size (VmHWM) starts again from here
before = resident_mb("VmRSS")
big = build_dataset(ImageFolderConfig(root=sys.argv[2], image_size=224, resize=ResizeMode(sys.argv[3])), None, 0)
assert big[0][0].shape[0] == 3
print(resident_mb("VmHWM") - before)
"""


@pytest.mark.slow
@pytest.mark.parametrize("resize", ["pad", "none"])
@pytest.mark.process
def test_an_8000_px_jpeg_is_never_decoded_or_made_float_at_full_size(tmp_path: Path, resize: str) -> None:
    """Peak memory (the process's peak resident size) of checking and reading an 8000 x 8000 JPEG at 224 px: decoded
    in full it is 256 MB in PIL, as a float tensor 768 MB (measured: pad 2.1 GB, none 0.49 GB); decoded at 1/8 scale
    and resized before it becomes a tensor, a few MB."""
    import os
    import subprocess
    import sys

    (tmp_path / "small").mkdir()
    (tmp_path / "big").mkdir()
    Image.radial_gradient("L").resize((300, 300)).convert("RGB").save(tmp_path / "small" / "s.jpg")
    Image.radial_gradient("L").resize((8000, 8000)).convert("RGB").save(tmp_path / "big" / "b.jpg", quality=80)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", BIG_PHOTO_PEAK, str(tmp_path / "small"), str(tmp_path / "big"), resize],
        capture_output=True, text=True, timeout=300, cwd=root, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) < 100, done.stdout  # MB above the small photo's peak


def test_torchvision_data_sets_read_photos_upright(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchvision data set whose loader keeps the EXIF tag (PIL's open + convert, as torchvision's own) feeds the
    photo upright too."""
    import torchvision.datasets
    from torchvision.datasets.folder import default_loader

    from runner.data.images import standard_transform
    from runner.options.data.torchvision import TorchvisionDataConfig
    from runner.schema import ResizeMode

    save_oriented(upright_picture(), tmp_path / "a.jpg", 6, quality=95)

    class Photos(torch.utils.data.Dataset):  # the shape of torchvision's file-based data sets
        def __init__(self, root: str, download: bool, transform: object) -> None:
            self.root, self.transform = Path(root), transform

        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> tuple:
            return self.transform(default_loader(str(self.root / "a.jpg"))), 0

    monkeypatch.setattr(torchvision.datasets, "Photos", Photos, raising=False)
    cfg = TorchvisionDataConfig(dataset="Photos", root=str(tmp_path), image_size=20, resize=ResizeMode.none)
    x = build_dataset(cfg, None, 0)[0][0]
    expected = standard_transform(20, ResizeMode.none)(upright_picture())
    assert x.shape == expected.shape == (3, 20, 30)  # sideways it would be 30 x 20
    assert float((x - expected).abs().mean()) < 0.05  # JPEG only


# ---- resize=none keeps the aspect ratio, resize=pad letterboxes, crop cuts -------------------------------------------
def _composite(path: Path, width: int = 448, height: int = 224) -> None:
    """A two-colour photo: red left half, blue right half (a cat left, an espresso right, in miniature)."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, : width // 2, 0] = 255
    pixels[:, width // 2 :, 2] = 255
    Image.fromarray(pixels).save(path)


def _folder(tmp_path: Path, resize: str, size: int = 64):
    _composite(tmp_path / "wide.png")
    _composite(tmp_path / "square.png", 224, 224)
    config = make_config(
        "data=image_folder", f"data.root={tmp_path}", f"data.image_size={size}", f"data.resize={resize}"
    )
    return config.data, build_dataset(config.data, None, 0)


def test_resize_none_keeps_the_aspect_ratio_and_pads_the_batch(tmp_path: Path) -> None:
    data, dataset = _folder(tmp_path, "none")
    ids = [dataset[i][2] for i in range(len(dataset))]
    wide = dataset[ids.index("wide.png")][0]
    assert tuple(wide.shape) == (3, 64, 128)  # 448x224 -> short side 64, long side 128: nothing cut or squashed
    # Both halves are there: red on the left half, blue on the right half (in normalised units, red > 0 on the left).
    assert float(wide[0, :, :60].mean()) > 1.5 and float(wide[2, :, 68:].mean()) > 1.5
    x, _, batch_ids = next(iter(make_loader(dataset, data, torch.device("cpu"))))
    assert tuple(x.shape) == (2, 3, 64, 128)  # a batch is padded to its largest image
    square = x[batch_ids.index("square.png")]  # (3, 64, 128)
    assert torch.equal(square[:, :, 64:], torch.zeros(3, 64, 64))  # padded at the right with 0 (the mean colour)
    assert float(square[:, :, :64].abs().mean()) > 0.5


def test_resize_pad_letterboxes(tmp_path: Path) -> None:
    _, dataset = _folder(tmp_path, "pad")
    ids = [dataset[i][2] for i in range(len(dataset))]
    wide = dataset[ids.index("wide.png")][0]
    assert tuple(wide.shape) == (3, 64, 64)
    assert torch.equal(wide[:, :16], torch.zeros(3, 16, 64)) and torch.equal(wide[:, 48:], torch.zeros(3, 16, 64))
    content = wide[:, 16:48]  # (3, 32, 64): the whole photo at half size, aspect kept
    assert float(content[0, :, :30].mean()) > 1.5 and float(content[2, :, 34:].mean()) > 1.5


def test_crop_loses_the_ends_and_the_log_says_how_images_were_resized(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="runner.data"):
        _, dataset = _folder(tmp_path, "crop")
    assert "centre crop 64x64" in caplog.text and "cut off" in caplog.text
    ids = [dataset[i][2] for i in range(len(dataset))]
    wide = dataset[ids.index("wide.png")][0]
    assert tuple(wide.shape) == (3, 64, 64)
    with caplog.at_level(logging.INFO, logger="runner.data"):
        _folder(tmp_path, "pad")
    assert "letterboxed to 64x64" in caplog.text


def test_image_folder_default_keeps_the_whole_photo() -> None:
    assert make_config("data=image_folder", "data.root=/x").data.resize.value == "pad"


# ---- 16-bit images are scaled, not clipped ---------------------------------------------------------------------------
def test_16_bit_png_matches_its_8_bit_copy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    eight = rng.integers(0, 256, (40, 48), dtype=np.uint8)
    Image.fromarray(eight).save(tmp_path / "a8.png")
    Image.fromarray(eight.astype(np.uint16) * 257).save(tmp_path / "b16.png")  # the same picture in 16 bits
    with Image.open(tmp_path / "b16.png") as im:
        assert im.mode.startswith("I")  # PIL opens it as a 16-bit grey image
        rgb = np.asarray(pil_to_rgb(im))
    assert np.array_equal(rgb[..., 0], eight)
    config = make_config("data=image_folder", f"data.root={tmp_path}", "data.image_size=32", "data.resize=square")
    dataset = build_dataset(config.data, None, 0)
    tensors = {dataset[i][2]: dataset[i][0] for i in range(2)}
    # Means in 0-1 pixel units (undoing the normalisation's std) agree within 1/255.
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    gap = ((tensors["b16.png"] - tensors["a8.png"]) * std).mean(dim=(1, 2)).abs().max()
    assert float(gap) <= 1 / 255


def test_16_bit_dark_image_is_not_taken_for_8_bit() -> None:
    dark = np.full((4, 4), 200, dtype=np.uint16)  # 200 of 65535: nearly black, not 200 of 255
    with Image.fromarray(dark) as im:
        assert int(np.asarray(pil_to_rgb(im)).max()) == 1


# ---- a folder of unreadable images -----------------------------------------------------------------------------------
def test_every_image_unreadable_says_which_and_how_to_fix(tmp_path: Path) -> None:
    for name in ("a.png", "b.jpg"):
        (tmp_path / name).write_bytes(b"not an image")
    with pytest.raises(RunnerError, match=r"Every image in .* \(2 file\(s\): a.png, b.jpg\).*point data.root"):
        build_dataset(make_config("data=image_folder", f"data.root={tmp_path}").data, None, 0)
