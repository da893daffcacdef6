"""vitjax.images: expanding inputs, loading every kind of source, and errors that name the bad input."""

from __future__ import annotations

import base64
import io
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PHOTOS, TINY
from PIL import Image, ImageFile

import vitjax
from vitjax.images import ImageInputError, encoded_bytes, expand_inputs, load_image, path_error
from vitjax.video import is_video_path

PHOTO = Path(__file__).parent / "data" / "images" / "astronaut.jpg"


def jpeg_bytes(size: tuple[int, int] = (64, 48), color: tuple[int, int, int] = (10, 120, 200)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def expect_error(source: object, reason: str, name: str | None = None) -> ImageInputError:
    """Loading `source` fails with an ImageInputError whose message starts with the input's name."""
    with pytest.raises(ImageInputError, match=reason) as info:
        load_image(source)
    error = info.value
    expected = name if name is not None else str(source)
    assert error.name == expected and str(error).startswith(f"{expected}: ")
    assert isinstance(error, ValueError)
    return error


# --- expand_inputs -----------------------------------------------------------------------------------------


def test_directory_expands_recursively_in_sorted_order(tmp_path):
    for rel in [
        "b.png",
        "a/z.JPG",
        "a/b/c.webp",
        "a/y.tiff",
        "c.gif",
        "notes.txt",
        "d.bmp",
        "e.jpeg",
        "f.tif",
        "g.avif",
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "h.jpg").write_bytes(b"x")
    (tmp_path / "._resource.jpg").write_bytes(b"x")
    names = [name for name, _ in expand_inputs([tmp_path])]
    expected = ["a/b/c.webp", "a/y.tiff", "a/z.JPG", "b.png", "c.gif", "d.bmp", "e.jpeg", "f.tif", "g.avif"]
    assert names == [str(tmp_path / rel) for rel in expected]
    assert [src for _, src in expand_inputs(str(tmp_path))] == [tmp_path / rel for rel in expected]


def test_directory_scan_follows_links_once_and_keeps_what_it_cannot_read(tmp_path):
    """A linked folder is searched once (under its real name when that is in the tree too), a link back up
    ends (a folder scanned from below does not take in the files beside it), a broken link is kept as an input
    (loading it says why), a fifo named like an image is refused."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "x.png").write_bytes(b"x")
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "up").symlink_to(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "y.gif").write_bytes(b"y")
    (tmp_path / "real" / "more").symlink_to(tmp_path / "other")
    (tmp_path / "dead.jpg").symlink_to(tmp_path / "nowhere.jpg")
    os.mkfifo(tmp_path / "pipe.png")
    names = [name for name, _ in expand_inputs([tmp_path])]
    assert names == [str(tmp_path / p) for p in ("dead.jpg", "other/y.gif", "pipe.png", "real/x.png")]
    expect_error(tmp_path / "dead.jpg", f"broken symbolic link \\(to {tmp_path / 'nowhere.jpg'}\\)")
    expect_error(tmp_path / "pipe.png", "not a regular file")
    # from `real`, the link up is a loop, not a way out to the files beside it; a link elsewhere is followed
    inside = [name for name, _ in expand_inputs(tmp_path / "real")]
    assert inside == [str(tmp_path / p) for p in ("real/more/y.gif", "real/x.png")]
    # a scanned link (home/photos, to store/p) whose folder links back to the folder holding the link (home)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "beside.png").write_bytes(b"x")
    (tmp_path / "store" / "p").mkdir(parents=True)
    (tmp_path / "store" / "p" / "z.png").write_bytes(b"z")
    (tmp_path / "store" / "p" / "back").symlink_to(tmp_path / "home")
    (tmp_path / "home" / "photos").symlink_to(tmp_path / "store" / "p")
    assert [name for name, _ in expand_inputs(tmp_path / "home" / "photos")] == [str(tmp_path / "home/photos/z.png")]


def test_expand_keeps_order_and_names_every_kind(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "one.png")
    data = jpeg_bytes()
    pil = Image.new("RGB", (4, 4))
    array = np.zeros((4, 4, 3), np.uint8)
    uri = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    pairs = expand_inputs([str(PHOTO), data, folder, uri, pil, array, tmp_path / "missing.jpg", 42])
    assert [name for name, _ in pairs] == [
        str(PHOTO),
        "<bytes #1>",
        str(folder / "one.png"),
        "<data URI #3>",
        "<PIL image #4>",
        "<array #5>",
        str(tmp_path / "missing.jpg"),
        "<int #7>",
    ]
    assert pairs[1][1] is data and pairs[4][1] is pil and pairs[5][1] is array


def test_a_bad_item_costs_only_itself(tmp_path):
    """expand_inputs never raises; each item fails or succeeds on its own when loaded."""
    missing = tmp_path / "gone.jpg"
    pairs = expand_inputs([PHOTO, missing, b"", jpeg_bytes()])
    results = []
    for name, source in pairs:
        try:
            results.append(load_image(source, name).size)
        except ImageInputError as e:
            results.append(e.name)
    assert results == [(512, 512), str(missing), "<bytes #2>", (64, 48)]


def test_single_input_is_accepted():
    assert expand_inputs(PHOTO) == [(str(PHOTO), PHOTO)]
    # Only lists, tuples and iterators hold several inputs: a tensor or a file object is one input (its rows or
    # lines used to become dozens of inputs, each an error), refused by name when loaded.
    tensor, stream = torch.zeros(40, 60, 3, dtype=torch.uint8), io.BytesIO(PHOTO.read_bytes())
    assert expand_inputs(tensor) == [("<Tensor #0>", tensor)] and expand_inputs(stream) == [("<BytesIO #0>", stream)]
    assert [n for n, _ in expand_inputs(p for p in [PHOTO, PHOTO])] == [str(PHOTO)] * 2
    expect_error(stream, "unsupported input type BytesIO", name="<BytesIO #0>")


def test_one_lazy_pil_image_twice_in_a_request():
    """The same lazily opened PIL image, several times in one request: PIL's load() is not thread-safe, and the
    copies, prepared in parallel, came back as false "corrupt" errors or as wrong pixels without an error."""
    enc = vitjax.Encoder.random(TINY["hd64"], dtype="float32", cache_bytes=0)
    png = io.BytesIO()
    Image.open(PHOTO).convert("RGB").resize((96, 64)).save(png, "PNG")
    (alone,) = enc.encode([Image.open(io.BytesIO(png.getvalue()))])
    for _ in range(10):
        results = enc.encode([Image.open(io.BytesIO(png.getvalue()))] * 4, errors="return")
        assert {getattr(r, "sha256", r) for r in results} == {alone.sha256}


# --- load_image: what comes out ----------------------------------------------------------------------------


def test_loads_every_source_kind_as_the_same_rgb_image():
    data = PHOTO.read_bytes()
    reference = np.array(Image.open(PHOTO).convert("RGB"))
    sources = [
        PHOTO,
        str(PHOTO),
        data,
        memoryview(data),
        "data:image/jpeg;base64," + base64.b64encode(data).decode(),
        Image.open(PHOTO),
        reference,
    ]
    for source in sources:
        image = load_image(source)
        assert image.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(image), reference)


def test_gray_and_rgba_arrays_become_rgb():
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    np.testing.assert_array_equal(np.asarray(load_image(gray)), np.repeat(gray[..., None], 3, axis=2))
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 0)  # fully transparent: the colour under it stays (alpha dropped, as HF 5.19 does)
    rgba[0, 1] = (0, 0, 0, 255)
    rgba[1] = (200, 100, 0, 128)
    np.testing.assert_array_equal(np.asarray(load_image(rgba)), rgba[..., :3])


def test_truncated_images_stay_an_error_globally():
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


# --- load_image: errors that name the input ----------------------------------------------------------------


def test_missing_path(tmp_path):
    expect_error(tmp_path / "nope.jpg", "no such file")
    expect_error(str(tmp_path / "nope.jpg"), "no such file")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jpg"
    path.write_bytes(b"")
    expect_error(path, r"empty input \(0 bytes\)")
    expect_error(b"", "empty input", name="<bytes #0>")


def test_truncated_jpeg(tmp_path):
    path = tmp_path / "cut.jpg"
    path.write_bytes(PHOTO.read_bytes()[: PHOTO.stat().st_size // 2])
    assert Image.open(path).size == (512, 512)  # the header is intact: only a full decode notices
    expect_error(path, "corrupt or truncated image data .*truncated")


def test_lazily_opened_truncated_image(tmp_path):
    """A PIL image opened (header only) from a truncated RGB file decodes in `load_image`, where it fails by name."""
    lazy = Image.open(io.BytesIO(PHOTO.read_bytes()[: PHOTO.stat().st_size // 2]))
    assert lazy.mode == "RGB"  # nothing to convert: only an explicit load notices
    expect_error(lazy, "corrupt or truncated image data .*truncated", name="<PIL image #0>")


def test_path_that_cannot_be_looked_at(tmp_path):
    long_name = tmp_path / ("x" * 300 + ".jpg")  # longer than a file name may be: stat fails, not "missing"
    assert expand_inputs([long_name]) == [(str(long_name), long_name)]
    expect_error(long_name, r"cannot look at the path \(File name too long\)")


def test_text_file_named_jpg(tmp_path):
    path = tmp_path / "notes.jpg"
    path.write_text("this is not an image\n")
    expect_error(path, "not a recognised image format")


def test_a_large_file_that_is_no_image_is_refused_from_its_header(tmp_path):
    """256 MiB that PIL does not recognise (a sparse file of zeros named .jpg): refused by name without being read
    into memory whole, by the PIL path and the one DALI's decoder takes (`encoded_bytes`); a large image is read."""
    path = tmp_path / "disk-image.jpg"
    with path.open("wb") as f:
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        expect_error(path, "not a recognised image format")
        with pytest.raises(ImageInputError, match="not a recognised image format"):
            encoded_bytes(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # reading the file whole takes 256 MiB
    big = tmp_path / "big.png"
    Image.new("RGB", (2000, 2000)).save(big)
    assert encoded_bytes(big) == big.read_bytes()


def test_directory_without_images(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "readme.txt").write_text("no pictures here")
    assert expand_inputs([folder]) == [(str(folder), folder)]
    expect_error(folder, r"directory contains no image or video files \(3gp, avi, avif, bmp, .*, webm, webp, wmv\)")


def test_path_error_names_what_loading_will_refuse(tmp_path):
    """Found without reading a file, with the reason loading gives: a missing path, a folder (with images or none:
    callers expand folders first), a URL. A file (even one that is no image) and non-path inputs are left to loading."""
    empty, notes = tmp_path / "empty", tmp_path / "notes"
    empty.mkdir()
    notes.mkdir()
    (notes / "readme.jpg.txt").write_text("no pictures")
    (tmp_path / "bad.jpg").write_text("not an image")
    for source in (tmp_path / "gone.jpg", empty, str(notes), PHOTO.parent, "http://example.com/a.jpg"):
        error = path_error(str(source), source)
        with pytest.raises(ImageInputError) as loaded:
            load_image(source)
        assert error is not None and (error.name, error.reason) == (loaded.value.name, loaded.value.reason)
    assert path_error(str(notes), notes).reason.startswith("directory contains no image or video files (3gp, avi,")
    for source in (tmp_path / "bad.jpg", str(PHOTO), "data:image/png;base64,AAAA", b"", 3.5):
        assert path_error("input", source) is None


def test_decompression_bomb_is_refused_without_decoding(tmp_path, monkeypatch):
    """Above MAX_IMAGE_PIXELS but under 2x PIL only warns; vitjax refuses. The file is also truncated, so
    getting the size error (not a truncation error) shows the pixels were never decoded."""
    path = tmp_path / "bomb.jpg"
    data = jpeg_bytes((120, 100))
    path.write_bytes(data[: data.index(b"\xff\xda") + 20])  # headers intact, scan data cut short
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    with pytest.warns(Image.DecompressionBombWarning):
        expect_error(path, r"120x100 = 12000 pixels exceeds the limit of 10000")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000)  # over 2x: PIL itself raises at open
    expect_error(path, "exceeds limit of 10000 pixels")
    expect_error(Image.new("RGB", (120, 100)), "exceeds the limit of 5000", name="<PIL image #0>")


def test_bad_data_uris():
    jpeg = base64.b64encode(PHOTO.read_bytes()).decode()
    for header in ("data:image/jpeg;BASE64,", "data:image/jpeg; base64,", "data:image/jpeg,"):  # HF reads these too
        assert np.array_equal(np.asarray(load_image(header + jpeg)), np.asarray(load_image(PHOTO)))
    # A raw base64 string (HF's load_image decodes it) is no path: named short, with what to pass instead.
    error = expect_error(
        jpeg,
        "^<str #0, .* characters>: not a path; an encoded image in a string is a data URI",
        name=f"<str #0, {len(jpeg)} characters>",
    )
    assert len(str(error)) < 200
    expect_error("data:image/png;base64", "malformed data URI", name="<data URI #0>")
    expect_error("data:image/svg+xml,%3Csvg%3E%3C/svg%3E", "not valid base64", name="<data URI #0>")  # percent-encoded
    expect_error("data:image/png;base64,***not base64***", "not valid base64", name="<data URI #0>")
    mime = "data:image/jpeg;base64," + base64.encodebytes(PHOTO.read_bytes()).decode()  # a newline every 76
    assert "\n" in mime and np.array_equal(np.asarray(load_image(mime)), np.asarray(load_image(PHOTO)))
    valid_b64_not_image = "data:image/png;base64," + base64.b64encode(b"hello world").decode()
    expect_error(valid_b64_not_image, "not a recognised image format", name="<data URI #0>")
    ((name, source),) = expand_inputs([PHOTO, "data:image/png;base64,@@"])[1:]
    with pytest.raises(ImageInputError, match=r"^<data URI #1>: data URI payload is not valid base64"):
        load_image(source, name)


@pytest.mark.parametrize(
    ("array", "reason"),
    [
        (np.zeros((4, 4, 3), np.float32), "dtype must be uint8, got float32"),
        (np.zeros((4, 4, 3), np.uint16), "dtype must be uint8, got uint16"),
        (
            np.zeros((4, 4, 2), np.uint8),
            r"shape must be HxW, HxWx3 or HxWx4 \(channels last\), got \(4, 4, 2\)",
        ),
        (np.zeros((2, 4, 4, 3), np.uint8), r"got \(2, 4, 4, 3\)"),
        (np.zeros((0, 4, 3), np.uint8), r"got \(0, 4, 3\)"),
    ],
)
def test_bad_arrays(array, reason):
    expect_error(array, reason, name="<array #0>")


def test_image_without_pixels():
    expect_error(Image.new("RGB", (0, 5)), r"image has no pixels \(0x5\)", name="<PIL image #0>")


def test_unsupported_type_and_url():
    expect_error(3.5, "unsupported input type float", name="<float #0>")
    expect_error("https://example.com/cat.jpg", "URLs are not fetched")


def test_explicit_name_is_used(tmp_path):
    with pytest.raises(ImageInputError, match=r"^upload 7 \(cat\.jpg\): empty input"):
        load_image(b"", name="upload 7 (cat.jpg)")


class _BytesPath(os.PathLike):
    """A path-like whose path is bytes, as `os.PathLike` allows."""

    def __init__(self, path: Path):
        self.path = path

    def __fspath__(self) -> bytes:
        return os.fsencode(self.path)


def test_a_path_like_giving_bytes_is_read_as_its_path():
    """`Path` takes str paths only: a bytes path-like is read as the OS names the file, and costs nothing beside it."""
    ((name, source),) = expand_inputs([_BytesPath(PHOTOS[0])])
    assert name == str(PHOTOS[0]) and source == PHOTOS[0]
    assert np.array_equal(np.asarray(load_image(_BytesPath(PHOTOS[0]))), np.asarray(load_image(PHOTOS[0])))
    assert not is_video_path(_BytesPath(PHOTOS[0])) and is_video_path(_BytesPath(Path("clip.mp4")))
