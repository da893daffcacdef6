"""vitjax.preprocess is bit-exact with HF transformers' Qwen2VLImageProcessorPil as Qwen3-VL configures it, and with
its torchvision processor (`Qwen2VLImageProcessor`, what `AutoProcessor` builds) under backend="torchvision"."""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import PHOTOS, make_hf
from PIL import Image, ImageOps
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

from vitjax.images import ImageInputError
from vitjax.preprocess import LEVELS, MAX_PIXELS, MIN_PIXELS, TABLES, preprocess_image, smart_resize


@pytest.fixture(scope="module")
def hf() -> Qwen2VLImageProcessorPil:
    return make_hf()


@pytest.fixture(scope="module")
def hf_torchvision() -> Qwen2VLImageProcessor:
    return make_hf(backend="torchvision")


def run_hf(processor: Qwen2VLImageProcessorPil | Qwen2VLImageProcessor, image: object) -> tuple[np.ndarray, np.ndarray]:
    out = processor(images=image, return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def assert_same(ours: tuple[np.ndarray, np.ndarray], ref: tuple[np.ndarray, np.ndarray]) -> None:
    """Bit-identical pixel_values (compared as raw float32 bits) and equal grid_thw, both int64."""
    (pv, thw), (ref_pv, ref_thw) = ours, ref
    assert thw.dtype == np.int64 and thw.shape == (1, 3)
    np.testing.assert_array_equal(thw, ref_thw)
    assert pv.dtype == np.float32 and pv.shape == ref_pv.shape == (thw[0].prod(), 1536)
    if not np.array_equal(pv.view(np.uint32), ref_pv.astype(np.float32).view(np.uint32)):
        np.testing.assert_array_equal(pv, ref_pv)  # readable report of where they differ
        pytest.fail("pixel_values equal as numbers but differ in bits (signed zeros?)")


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    """High-frequency content: the hardest case for resampling parity."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def photo(name: str = "chelsea.png") -> Image.Image:
    return Image.open(Path(__file__).parent / "data" / "images" / name).convert("RGB")


# --- smart_resize ------------------------------------------------------------------------------------------


def test_smart_resize_matches_hf_on_random_sizes():
    rnd = random.Random(0)
    sizes = [(rnd.randint(1, 6000), rnd.randint(1, 6000)) for _ in range(300)]
    sizes += [(rnd.randint(1, 64), rnd.randint(1, 64)) for _ in range(50)]  # min-pixels branch
    sizes += [(272, 1024), (336, 1024), (304, 1024), (1024, 272), (5000, 8000), (16, 3200)]
    sizes = [(h, w) for h, w in sizes if max(h, w) / min(h, w) <= 200]
    assert len(sizes) > 300
    for h, w in sizes:
        assert smart_resize(h, w) == hf_smart_resize(h, w, factor=32, min_pixels=65536, max_pixels=16777216)
    for h, w in sizes[:50]:
        assert smart_resize(h, w, 28, 3136, 1003520) == hf_smart_resize(h, w, 28, 3136, 1003520)


def test_smart_resize_rounds_half_to_even():
    # 272/32 = 8.5 -> 8, 336/32 = 10.5 -> 10, 304/32 = 9.5 -> 10 (Python round, as HF)
    assert smart_resize(272, 1024) == (256, 1024)
    assert smart_resize(336, 1024) == (320, 1024)
    assert smart_resize(304, 1024) == (320, 1024)


@pytest.mark.parametrize(
    ("width", "height", "resized"),
    [
        (640, 480, (480, 640)),
        (1001, 333, (320, 992)),
        (123, 77, (224, 352)),
        (32, 32, (256, 256)),
        (48, 48, (256, 256)),
        (250, 4000, (4000, 256)),
        (5000, 3000, (3008, 4992)),
    ],
)
def test_smart_resize_spec_table(width, height, resized):
    assert smart_resize(height, width) == resized == hf_smart_resize(height, width, 32, 65536, 16777216)


def test_smart_resize_aspect_limit():
    # exactly 200:1 is allowed, as in HF
    assert smart_resize(200, 40000) == hf_smart_resize(200, 40000, 32, 65536, 16777216)
    with pytest.raises(ValueError, match=r"aspect ratio 201 .*limit of 200"):
        smart_resize(2, 402)
    with pytest.raises(ValueError, match="absolute aspect ratio must be smaller than 200, got 201"):
        hf_smart_resize(2, 402, factor=32, min_pixels=65536, max_pixels=16777216)


# --- real photographs and odd sizes ------------------------------------------------------------------------


@pytest.mark.parametrize(("low", "high"), [(65536, 0), (65536, -5), (10**8, 16777216), (0, 65536)])
def test_pixel_bounds_no_resize_can_meet_are_refused_before_the_input_is_read(low, high):
    with pytest.raises(ValueError, match=rf"min_pixels={low}, max_pixels={high}: need 1 <= min_pixels <= max_pixels"):
        preprocess_image(b"never read", min_pixels=low, max_pixels=high)


@pytest.mark.parametrize(
    ("setting", "kw"),
    [
        ("min_pixels='1'", {"min_pixels": "1"}),
        ("max_pixels=None", {"max_pixels": None}),
        ("patch_size must be a positive integer, got 0", {"patch_size": 0}),
        ("merge_size must be a positive integer, got 2.0", {"merge_size": 2.0}),
        ("temporal_patch_size must be a positive integer, got 0", {"temporal_patch_size": 0}),
    ],
)
def test_settings_of_another_kind_are_refused_by_name_before_the_input_is_read(setting, kw):
    """Not a bare TypeError or ZeroDivisionError, nor (temporal_patch_size 0) rows of no columns."""
    with pytest.raises(ValueError, match=setting):
        preprocess_image(b"never read", **kw)


def test_bounds_hf_takes_are_taken():
    """numpy integers, whole floats and an unbounded max_pixels, as HF's smart_resize takes them."""
    ref = preprocess_image(PHOTOS[0])
    for kw in [{"min_pixels": np.int64(MIN_PIXELS)}, {"max_pixels": float(MAX_PIXELS)}, {"max_pixels": float("inf")}]:
        pixels, grid = preprocess_image(PHOTOS[0], **kw)
        np.testing.assert_array_equal(grid, ref[1])
        np.testing.assert_array_equal(pixels, ref[0])


def test_photos_are_shipped():
    assert len(PHOTOS) >= 6
    assert {p.suffix for p in PHOTOS} == {".jpg", ".png"}


@pytest.mark.parametrize("path", PHOTOS, ids=lambda p: p.name)
def test_photo_matches_hf(hf, path):
    assert_same(preprocess_image(path), run_hf(hf, Image.open(path)))


@pytest.mark.parametrize(
    ("width", "height"),
    [
        (5, 7),
        (7, 5),
        (123, 77),
        (1001, 333),
        (641, 479),
        (250, 4000),
        (3, 500),
        (500, 3),
        (33, 1000),
        (5000, 3000),
    ],
)
def test_odd_sizes_match_hf(hf, width, height):
    image = noise(width, height)
    assert_same(preprocess_image(image), run_hf(hf, image))


def test_one_by_one_pixel_matches_hf(hf):
    """HF handles a 1x1 PIL image (grid 1x16x16). Given a 1x1x3 array it guesses channels-first and returns
    a different grid; vitjax reads arrays as channels-last always, so it equals HF on the PIL image."""
    image = Image.new("RGB", (1, 1), (200, 30, 90))
    ref = run_hf(hf, image)
    np.testing.assert_array_equal(ref[1], [[1, 16, 16]])
    assert_same(preprocess_image(image), ref)
    assert_same(preprocess_image(np.array(image)), ref)


def test_other_geometry_matches_hf():
    """Parameters are honoured: Qwen2-VL patch 14 and qwen-vl-utils' smaller minimum."""
    image = noise(301, 97, seed=3)
    pv, thw = preprocess_image(image, 4096, 1_000_000, patch_size=14)
    ref_pv, ref_thw = run_hf(make_hf(patch=14, min_pixels=4096, max_pixels=1_000_000), image)
    np.testing.assert_array_equal(thw, ref_thw)
    assert pv.shape == ref_pv.shape == (thw[0].prod(), 3 * 2 * 14 * 14)
    assert np.array_equal(pv.view(np.uint32), ref_pv.view(np.uint32))


def test_downscale_branch_matches_hf():
    image = noise(1500, 1100, seed=4)
    ours = preprocess_image(image, max_pixels=200_000)
    assert_same(ours, run_hf(make_hf(max_pixels=200_000), image))
    assert ours[0].shape[0] * 16 * 16 <= 200_000


def test_temporal_halves_are_identical():
    pv, _ = preprocess_image(photo())
    rows = pv.reshape(-1, 3, 2, 256)
    np.testing.assert_array_equal(rows[:, :, 0], rows[:, :, 1])


# --- image modes and file formats --------------------------------------------------------------------------


def _rgba(size: tuple[int, int] = (173, 141)) -> Image.Image:
    """A photo crop with an alpha ramp, fully transparent in one corner, noise under the transparency."""
    rgb = np.array(photo().resize(size))
    h, w = rgb.shape[:2]
    ramp = np.linspace(-80, 300, w)[None, :] + np.linspace(0, 60, h)[:, None]
    alpha = np.clip(ramp, 0, 255).astype(np.uint8)
    rgb[alpha == 0] = np.random.default_rng(1).integers(0, 256, (int((alpha == 0).sum()), 3), dtype=np.uint8)
    return Image.fromarray(np.dstack([rgb, alpha]), mode="RGBA")


def _write(kind: str, directory: Path) -> tuple[Path, str]:
    """Write one test file; return its path and the mode PIL must open it in (so the case is real)."""
    base = photo().resize((187, 131))
    path = directory / f"{kind}.{kind.split('_')[0]}"
    if kind == "png_gray":
        base.convert("L").save(path)
        return path, "L"
    if kind == "png_la":
        _rgba().convert("LA").save(path)
        return path, "LA"
    if kind == "png_rgba":
        _rgba().save(path)
        return path, "RGBA"
    if kind == "png_palette":
        rgba = _rgba()
        pal = rgba.convert("RGB").quantize(63)  # indices 0..62; 63 becomes the transparent red entry
        pal.putpalette(pal.getpalette()[: 63 * 3] + [255, 0, 0])
        pixels = np.array(pal)
        pixels[np.asarray(rgba)[..., 3] < 128] = 63
        out = Image.fromarray(pixels, mode="P")
        out.putpalette(pal.getpalette())
        out.save(path, transparency=63)
        return path, "P"
    if kind == "png_16bit":
        levels = (np.asarray(base.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
        Image.fromarray(levels).save(path)
        return path, "I;16"
    if kind == "jpg_cmyk":
        base.convert("CMYK").save(path, quality=90)
        return path, "CMYK"
    if kind == "gif":
        first = _rgba().convert("RGB").quantize(128)
        second = noise(*first.size).quantize(128)
        first.save(path, save_all=True, append_images=[second], transparency=0, duration=100, loop=0)
        return path, "P"
    if kind == "webp":
        base.save(path, quality=80)
        return path, "RGB"
    if kind == "webp_rgba":
        _rgba().save(path, lossless=True)
        return path, "RGBA"
    if kind in ("bmp", "tiff", "avif"):
        base.save(path)
        return path, "RGB"
    raise AssertionError(kind)


KINDS = [
    "png_gray",
    "png_la",
    "png_rgba",
    "png_palette",
    "png_16bit",
    "jpg_cmyk",
    "gif",
    "webp",
    "webp_rgba",
    "bmp",
    "tiff",
    pytest.param("avif", marks=pytest.mark.skipif(".avif" not in Image.registered_extensions(), reason="no AVIF here")),
]
TRANSPARENT = {"png_la", "png_rgba", "png_palette", "gif", "webp_rgba"}


@pytest.mark.parametrize("kind", KINDS)
def test_format_and_mode_match_hf(hf, tmp_path, kind):
    path, mode = _write(kind, tmp_path)
    opened = Image.open(path)
    assert opened.mode == mode
    ref = run_hf(hf, opened)
    assert_same(preprocess_image(path), ref)
    assert_same(preprocess_image(path.read_bytes()), ref)
    if kind in TRANSPARENT:  # the case tells alpha dropped (HF 5.19, checked) from composited onto white (5.23)
        rgba = Image.open(path).convert("RGBA")
        white = Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba)
        assert not np.array_equal(np.asarray(white.convert("RGB")), np.asarray(rgba.convert("RGB")))


def test_16bit_png_is_clipped_like_hf(hf, tmp_path):
    """Pillow's I;16 -> RGB clips at 255 (no scaling); HF's processor, by path or by PIL, gives that."""
    path, _ = _write("png_16bit", tmp_path)
    ours = preprocess_image(path)
    assert_same(ours, run_hf(hf, str(path)))
    assert (ours[0] == 1.0).mean() > 0.9  # nearly all white: the documented, HF-matching behaviour


def test_gif_uses_first_frame(tmp_path):
    path, _ = _write("gif", tmp_path)
    with Image.open(path) as gif:
        assert gif.n_frames == 2
        gif.seek(1)
        second = preprocess_image(gif.convert("RGB"))
    first = preprocess_image(path)
    assert not np.array_equal(first[0], second[0])
    assert_same(first, preprocess_image(Image.open(path)))


def test_exif_orientation_is_applied_like_hf_load_image(hf, tmp_path):
    """HF's load_image (string inputs) applies exif_transpose; vitjax does for every input form."""
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    photo().save(path, quality=90, exif=exif)
    upright = ImageOps.exif_transpose(Image.open(path))
    assert upright.size == (300, 451)
    ref = run_hf(hf, str(path))
    assert_same(ref, run_hf(hf, upright))
    assert_same(preprocess_image(path), ref)
    assert_same(preprocess_image(Image.open(path)), ref)
    assert_same(preprocess_image(path.read_bytes()), ref)


# --- input forms -------------------------------------------------------------------------------------------


def test_every_input_form_gives_the_same_result(hf):
    path = next(p for p in PHOTOS if p.name == "coffee.jpg")
    data = path.read_bytes()
    array = np.array(Image.open(path))
    ref = run_hf(hf, str(path))
    assert_same(ref, run_hf(hf, array))
    forms = [
        path,
        str(path),
        data,
        bytearray(data),
        "data:image/jpeg;base64," + base64.b64encode(data).decode(),
        Image.open(path),
        Image.open(io.BytesIO(data)).convert("RGB"),
        array,
        np.asfortranarray(array),
    ]
    for form in forms:
        assert_same(preprocess_image(form), ref)


def test_rgba_array_matches_hf_on_the_rgba_image(hf):
    """An HxWx4 array means the RGBA PIL image of its pixels. HF itself refuses such an array (5.19, checked: it
    cannot infer the channel axis), so vitjax is compared with HF on that image. Every (value, alpha) pair occurs."""
    value, alpha = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8))
    array = np.dstack([value, value[::-1], value.T, alpha])
    ref = run_hf(hf, Image.fromarray(array))
    assert_same(preprocess_image(array), ref)
    assert_same(preprocess_image(Image.fromarray(array)), ref)
    assert_same(preprocess_image(array[:200, :150]), run_hf(hf, Image.fromarray(array[:200, :150])))


def test_gray_array_matches_hf_on_gray_image(hf):
    array = np.asarray(photo().convert("L").resize((97, 203)))
    assert_same(preprocess_image(array), run_hf(hf, Image.fromarray(array, mode="L")))


# --- errors ------------------------------------------------------------------------------------------------


def test_extreme_aspect_ratio_is_an_error_naming_the_input(hf, tmp_path):
    path = tmp_path / "strip.png"
    noise(600, 2).save(path)
    with pytest.raises(ValueError, match="absolute aspect ratio must be smaller than 200, got 300"):
        run_hf(hf, Image.open(path))
    with pytest.raises(ImageInputError, match=r"aspect ratio 300 .*limit of 200") as info:
        preprocess_image(path)
    assert str(path) in str(info.value) and info.value.name == str(path)
    with pytest.raises(ImageInputError, match=r"^<bytes #0>: aspect ratio 300"):
        preprocess_image(path.read_bytes())
    with pytest.raises(ImageInputError, match=r"^strip #7: aspect ratio 300"):
        preprocess_image(Image.open(path), name="strip #7")


def test_load_errors_propagate_with_the_name(tmp_path):
    missing = tmp_path / "nope.jpg"
    with pytest.raises(ImageInputError, match="no such file") as info:
        preprocess_image(missing)
    assert info.value.name == str(missing)


def test_out_buffer_receives_the_same_rows():
    """`out=` writes into a caller's buffer (a batch's rows) exactly what the plain call returns."""
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (70, 90, 3), np.uint8))
    ref, grid = preprocess_image(image)
    batch = np.full((len(ref) + 8, ref.shape[1]), np.nan, np.float32)
    got, got_grid = preprocess_image(image, out=batch[4 : 4 + len(ref)])
    np.testing.assert_array_equal(batch[4 : 4 + len(ref)], ref)
    assert np.isnan(batch[:4]).all() and np.isnan(batch[4 + len(ref) :]).all()
    np.testing.assert_array_equal(got_grid, grid)
    with pytest.raises(ValueError, match=r"out must be a C-contiguous float32, bfloat16 or uint8 \(levels\) array"):
        preprocess_image(image, out=np.empty((len(ref), 10), np.float32))
    half = np.empty(ref.shape, ml_dtypes.bfloat16)
    preprocess_image(image, out=half)
    np.testing.assert_array_equal(half, ref.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_levels_rows_are_the_rows_before_the_table(backend):
    """A uint8 `out` gets each value's level: the backend's table maps them to its rows exactly (a resized image, so
    both backends' resizes are in it)."""
    image = noise(90, 70, seed=5)
    ref, grid = preprocess_image(image, min_pixels=32 * 32, max_pixels=96 * 64, backend=backend)
    assert tuple(grid[0]) == (1, 4, 6)  # resized from 90 x 70 to 96 x 64
    levels = np.empty(ref.shape, LEVELS)
    preprocess_image(image, min_pixels=32 * 32, max_pixels=96 * 64, out=levels, backend=backend)
    np.testing.assert_array_equal(TABLES[backend][levels], ref)


def test_both_tables_agree_once_rounded_to_16_bits():
    """What lets a 16-bit tower map levels on the device with one table, whichever HF processor made them (images of
    either backend, video frames): rounded to bfloat16 or float16 the tables agree. In float32 they do not."""
    for dtype in (ml_dtypes.bfloat16, np.float16):
        np.testing.assert_array_equal(TABLES["pil"].astype(dtype), TABLES["torchvision"].astype(dtype))
    assert (TABLES["pil"] != TABLES["torchvision"]).sum() == 128


# --- the torchvision processor (backend="torchvision") -------------------------------------------------------


def test_the_processor_a_released_checkpoint_loads_is_the_torchvision_one(tmp_path, hf_torchvision):
    """Qwen3-VL's released preprocessor_config.json (every size) names `Qwen2VLImageProcessorFast`: `AutoProcessor`
    in transformers 5, and SGLang (`--image-processor-backend auto` passes no backend), load the torchvision
    processor from it, whose rows backend="torchvision" gives and the default does not."""
    config = {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    loaded = AutoImageProcessor.from_pretrained(tmp_path)
    assert type(loaded) is Qwen2VLImageProcessor and loaded.backend == "torchvision"
    image = photo()  # 451 x 300: resized to 448 x 288
    ref = run_hf(loaded, image)
    assert_same(ref, run_hf(hf_torchvision, image))
    assert_same(preprocess_image(image, backend="torchvision"), ref)
    pil = preprocess_image(image)
    levels = np.abs(pil[0] - ref[0]) * 127.5
    assert levels.max() > 1.5  # another resize's rows (2 levels here; how many values differ varies with Pillow)


@pytest.mark.parametrize("path", PHOTOS, ids=lambda p: p.name)
def test_photo_matches_hf_torchvision(hf_torchvision, path):
    """Given the image `load_image` gives (HF's torchvision processor decodes a path itself, with torchvision:
    no EXIF orientation and alpha dropped; SGLang without CUDA hands it PIL images)."""
    assert_same(preprocess_image(path, backend="torchvision"), run_hf(hf_torchvision, Image.open(path)))


@pytest.mark.parametrize(("width", "height"), [(5, 7), (123, 77), (1001, 333), (3, 500), (33, 1000), (5000, 3000)])
def test_odd_sizes_match_hf_torchvision(hf_torchvision, width, height):
    image = noise(width, height)
    assert_same(preprocess_image(image, backend="torchvision"), run_hf(hf_torchvision, image))


def test_torchvision_backend_honours_the_bounds_and_geometry():
    image = noise(1500, 1100, seed=4)
    ours = preprocess_image(image, max_pixels=200_000, backend="torchvision")
    assert_same(ours, run_hf(make_hf(max_pixels=200_000, backend="torchvision"), image))
    pv, thw = preprocess_image(image, 4096, 1_000_000, patch_size=14, backend="torchvision")
    ref_pv, ref_thw = run_hf(make_hf(patch=14, min_pixels=4096, max_pixels=1_000_000, backend="torchvision"), image)
    np.testing.assert_array_equal(thw, ref_thw)
    assert np.array_equal(pv.view(np.uint32), ref_pv.view(np.uint32))


@pytest.mark.parametrize("kind", ["png_la", "png_palette", "png_16bit", "jpg_cmyk", "webp_rgba"])
def test_formats_match_hf_torchvision(hf_torchvision, tmp_path, kind):
    path, _ = _write(kind, tmp_path)
    assert_same(preprocess_image(path, backend="torchvision"), run_hf(hf_torchvision, Image.open(path)))


def test_torchvision_backend_writes_out_buffers_and_refuses_other_backends(tmp_path):
    image = noise(90, 70, seed=5)
    ref, _ = preprocess_image(image, backend="torchvision")
    half = np.empty(ref.shape, ml_dtypes.bfloat16)
    preprocess_image(image, out=half, backend="torchvision")
    np.testing.assert_array_equal(half, ref.astype(ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"backend must be one of 'pil', 'torchvision' .* got 'fast'"):
        preprocess_image(tmp_path / "never-read.png", backend="fast")  # refused before the input is read


def test_sglang_on_a_host_without_cuda_gives_the_tower_the_torchvision_rows(dense):
    """SGLang 0.5.23's own image loader and the processor it builds (`--image-processor-backend auto`), run as its
    `prepare_artifact_batch` runs them where there is no CUDA (`device="cpu"`): the rows backend="torchvision" gives.
    (On a GPU host SGLang decodes JPEGs with nvJPEG and resizes on the GPU: other rows, README.)"""
    from sglang.srt.utils.common import load_image as sglang_load_image
    from sglang.srt.utils.hf_transformers.processor import get_processor

    processor = get_processor(str(dense), image_processor_backend="auto").image_processor
    assert type(processor) is Qwen2VLImageProcessor and processor.backend == "torchvision"
    low, high = processor.size["shortest_edge"], processor.size["longest_edge"]
    for path in PHOTOS:
        image, _ = sglang_load_image(path.read_bytes(), True)  # use_gpu=True: where CUDA is missing, PIL decodes
        rows = processor(images=[image], return_tensors="pt", device="cpu")["pixel_values"].numpy()
        ours, _ = preprocess_image(path, low, high, backend="torchvision")
        assert np.array_equal(ours.view(np.uint32), rows.view(np.uint32)), path.name
