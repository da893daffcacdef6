"""vitjax.pil_pixels: an RGB PIL image's pixels viewed in place (Arrow export), equal to numpy's copy, never
through `Image.tobytes` where Pillow holds the image in one block; the digest and rows built on it unchanged."""

from __future__ import annotations

import gc
import hashlib
from pathlib import Path

import numpy as np
import PIL
import pytest
from PIL import Image

import vitjax.preprocess
from vitjax.cache import pixel_digest
from vitjax.images import load_image
from vitjax.pil_pixels import rgb_bytes, rgb_pixels
from vitjax.preprocess import LEVELS, preprocess_image
from vitjax.resize import resize_bicubic

PHOTOS = Path(__file__).parent / "data" / "images"
RNG = np.random.default_rng(7)


def random_image(height: int, width: int) -> Image.Image:
    return Image.fromarray(RNG.integers(0, 256, (height, width, 3), np.uint8))


def one_block(image: Image.Image) -> bool:
    """Whether Pillow exports this image's memory in one piece (its 16 MiB block holds the image)."""
    try:
        image.__arrow_c_array__()
    except ValueError:
        return False
    return True


def no_tobytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Pillow's tobytes (and with it np.asarray of an image) fail: what runs on must not use it."""

    def refuse(*args, **kwargs):
        raise AssertionError("Image.tobytes was called")

    monkeypatch.setattr(Image.Image, "tobytes", refuse)


@pytest.mark.parametrize("size", [(1, 1), (3, 2), (31, 17), (960, 1280), (2048, 2048), (2049, 2048), (4000, 3000)])
def test_rgb_pixels_equal_numpys_copy(size):
    image = random_image(*size)
    expected = np.asarray(image)
    pixels = rgb_pixels(image)
    assert pixels.shape == (*size, 3) and pixels.dtype == np.uint8 and not pixels.flags.writeable
    np.testing.assert_array_equal(pixels, expected)
    packed = rgb_bytes(image)
    assert packed.flags.c_contiguous and packed.tobytes() == image.tobytes()
    # a view where Pillow holds the image in one block (up to 16 MiB: 2048 x 2048 in RGBX), numpy's copy beyond
    assert (pixels.strides[1] == 4) == one_block(image) == (size[0] * size[1] <= 2048 * 2048)


def test_images_made_by_pillow_operations():
    """Rotated, cropped and converted images (what `load_image` makes of EXIF orientations and other modes)."""
    base = random_image(300, 200)
    rgba = Image.fromarray(RNG.integers(0, 256, (10, 20, 4), np.uint8), "RGBA")
    for image in (base.transpose(Image.Transpose.ROTATE_90), base.crop((10, 20, 110, 220)), rgba.convert("RGB")):
        np.testing.assert_array_equal(rgb_pixels(image), np.asarray(image))
        assert rgb_bytes(image).tobytes() == image.tobytes()


def test_a_view_outlives_its_image():
    """The view holds the image (and its export): dropped by the caller and memory churned, the pixels stay."""
    pixels = rgb_pixels(random_image(500, 400))
    assert pixels.strides[1] == 4  # a view, not a copy
    expected = pixels.copy()
    gc.collect()
    churn = [random_image(500, 400) for _ in range(20)]
    np.testing.assert_array_equal(pixels, expected)
    assert len(churn) == 20


@pytest.fixture
def alignment():
    """Set Pillow's row alignment (`PILLOW_ALIGNMENT`) for a test; put back after it."""
    before = Image.core.get_alignment()
    yield Image.core.set_alignment
    Image.core.set_alignment(before)


@pytest.mark.parametrize("bytes_", [16, 64])
def test_padded_rows(alignment, bytes_):
    """Rows Pillow pads to an alignment are not one run: numpy's copy (Pillow before 13 exports them as unpadded)."""
    alignment(bytes_)
    image = random_image(7, 53)  # 53 x 4 bytes a row: padded under 16 and 64
    pixels = rgb_pixels(image)
    assert pixels.strides[1] == 3
    np.testing.assert_array_equal(pixels, np.asarray(image))
    assert rgb_bytes(image).tobytes() == image.tobytes()


@pytest.mark.skipif(int(PIL.__version__.split(".")[0]) < 13, reason="Pillow before 13 exports padded rows as unpadded")
def test_padded_rows_viewed_after_the_alignment_is_reset(alignment):
    alignment(64)
    image = random_image(7, 53)
    alignment(1)
    np.testing.assert_array_equal(rgb_pixels(image), np.asarray(image))


def test_refuses_other_modes():
    with pytest.raises(ValueError, match="RGB images, not RGBA"):
        rgb_pixels(Image.new("RGBA", (4, 4)))


def test_a_pillow_without_arrow_export(monkeypatch):
    """Pillow before 11.2 has no `__arrow_c_array__`: numpy's copy, the same pixels."""
    image = random_image(40, 30)
    monkeypatch.delattr(Image.Image, "__arrow_c_array__")
    pixels = rgb_pixels(image)
    assert pixels.strides[1] == 3
    np.testing.assert_array_equal(pixels, np.asarray(image))


def old_resized_pixels(image: Image.Image, height: int, width: int, backend: str = "pil") -> np.ndarray:
    """`resized_pixels` as it was through 2026-11-27: numpy's copy of the (always) resized image."""
    if backend == "pil":
        return np.asarray(image.resize((width, height), Image.Resampling.BICUBIC))
    return resize_bicubic(np.asarray(image), height, width)


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_digest_and_rows_without_tobytes(monkeypatch, backend):
    """A photo's digest (the cache key, `Encoded.sha256`) and rows, resized or not, are what the earlier code gave
    through tobytes, and they no longer go through it: a copy each that held Python's lock and kept preprocessing
    threads queued on a many-core host."""
    photo = load_image(PHOTOS / "coffee.jpg")  # 600 x 400: resized to a multiple of 32
    exact = random_image(256, 320)  # multiples of 32, at least min_pixels: not resized
    cases = []
    with monkeypatch.context() as before:
        before.setattr(vitjax.preprocess, "resized_pixels", old_resized_pixels)
        for image in (photo, exact):
            digest = hashlib.sha256(f"RGB:{image.width}x{image.height}:".encode() + image.tobytes()).hexdigest()
            rows, grid = preprocess_image(image, backend=backend)  # float32
            levels = preprocess_image(image, out=np.empty(rows.shape, LEVELS), backend=backend)[0]
            cases.append((image, digest, rows, grid, levels))
    no_tobytes(monkeypatch)
    resize = Image.Image.resize
    for image, digest, rows, grid, levels in cases:
        assert pixel_digest(image) == digest
        if image is exact:  # the same size: no resize at all (Pillow's would be a copy)
            monkeypatch.setattr(Image.Image, "resize", lambda *a, **k: pytest.fail("resized to its own size"))
        got, got_grid = preprocess_image(image, backend=backend)
        np.testing.assert_array_equal(got, rows)
        np.testing.assert_array_equal(got_grid, grid)
        np.testing.assert_array_equal(preprocess_image(image, out=np.empty_like(levels), backend=backend)[0], levels)
        monkeypatch.setattr(Image.Image, "resize", resize)
