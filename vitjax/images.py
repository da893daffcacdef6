"""Turn whatever a user holds (paths, folders, bytes, data URIs, PIL images, arrays) into RGB PIL images.

Conversion to RGB follows HF transformers 5.19, the version SGLang 0.5.23 pins (`image_transforms.convert_to_rgb`,
which its image processors apply to every PIL image they are given), so that `vitjax.preprocess` can be
bit-identical to HF's `Qwen2VLImageProcessorPil`. Every failure is an `ImageInputError` that names the
input, so one bad item in a batch can be reported without losing the others.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import ExifTags, Image, ImageOps

# AVIF needs a Pillow with AVIF support (`PIL.features.check("avif")`); without it such a file fails by name.
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".avif"})
# Video containers (`vitjax.video` decodes them): folder scans pick them up beside images.
VIDEO_EXTENSIONS = frozenset(
    {".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".flv", ".wmv", ".3gp", ".ogv"}
)
_EXTENSIONS = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
# Linux's PATH_MAX: a longer string is no path (a raw base64 image, say), and is not printed whole in errors.
MAX_PATH_CHARS = 4096
URL_REFUSED = "URLs are not fetched; download the image and pass its bytes or path"
# Held while a caller's lazily opened PIL image reads its file (only those; decoded inputs never wait).
_LAZY_LOAD_LOCK = threading.Lock()

ImageSource = str | os.PathLike | bytes | bytearray | memoryview | Image.Image | np.ndarray


class ImageInputError(ValueError):
    """An input that cannot be turned into an image; `name` says which one, `reason` why."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


def is_data_uri(source: object) -> bool:
    """A `data:` URI is a str; a path (a `Path`) whose name starts with "data:" is a file."""
    return isinstance(source, str) and source.startswith("data:")


def as_path(source: object) -> object:
    """A path-like input as a `Path`, anything else as it is: an `os.PathLike` may give its path as bytes, which
    `Path` refuses (decoded here as the OS names files)."""
    if isinstance(source, os.PathLike) and not isinstance(source, Path):
        try:
            return Path(os.fsdecode(os.fspath(source)))
        except TypeError:  # its __fspath__ gives no path: loading it names the error
            return source
    return source


def input_name(source: object, index: int = 0) -> str:
    """How errors name an input: a path names itself, anything else its kind and position among the inputs."""
    if is_data_uri(source):
        return f"<data URI #{index}>"
    if isinstance(source, str) and len(source) > MAX_PATH_CHARS:
        return f"<str #{index}, {len(source)} characters>"
    source = as_path(source)
    if isinstance(source, (str, Path)):
        return str(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<bytes #{index}>"
    if isinstance(source, Image.Image):
        return f"<PIL image #{index}>"
    if isinstance(source, np.ndarray):
        return f"<array #{index}>"
    return f"<{type(source).__name__} #{index}>"


def _files_under(directory: Path) -> list[Path]:
    """Files below `directory` with an image or video extension, recursively, sorted; links to folders are followed, a
    folder reached twice is searched once, and a link to a folder above it (a loop) is not followed: it would bring in
    the files beside `directory`.

    Hidden files and folders are skipped. What looks like an input but cannot be one is kept, so that loading
    it reports why by name: broken links, unreadable files, and folders that cannot be listed.
    """
    found: list[Path] = []
    seen: set[str] = set()
    for root, dirs, files in os.walk(directory, followlinks=True, onerror=lambda e: found.append(Path(e.filename))):
        real = os.path.realpath(root)
        if real in seen:
            dirs.clear()
            continue
        seen.add(real)
        visible = sorted(d for d in dirs if not d.startswith(".") and not _loops(os.path.join(root, d), root))
        # folders before links: real names win
        dirs[:] = sorted(visible, key=lambda d: os.path.islink(os.path.join(root, d)))
        found.extend(Path(root, f) for f in files if not f.startswith(".") and Path(f).suffix.lower() in _EXTENSIONS)
    return sorted(found)


def _loops(folder: str, parent: str) -> bool:
    """Whether `folder` is a link to the folder that holds it or to one above that, by the path walked or the real one
    (a scanned folder that is itself a link has two sets of folders above it)."""
    if not os.path.islink(folder):
        return False
    target = os.path.realpath(folder)
    return any(
        os.path.commonpath([target, above]) == target for above in (os.path.realpath(parent), os.path.abspath(parent))
    )


def expand_inputs(inputs: ImageSource | Iterable[ImageSource]) -> list[tuple[str, object]]:
    """Flatten inputs into `(name, source)` pairs, in order, expanding directories (into their image and video
    files). A `vitjax.Video` is one input, named by its path or as `<video #i>`.

    Never raises for a bad item (missing path, garbage bytes, wrong type): the error surfaces when that
    item is loaded, so it costs only itself. A directory without images is kept as one item for the
    same reason.
    """
    from vitjax.video import Video, video_name  # imported here: vitjax.video builds on this module

    # Lists, tuples and iterators (generators) hold inputs; anything else is one input (a tensor or a file object
    # is not split into its rows or lines: it is one input, refused by name if it is of no kind vitjax reads).
    many = isinstance(inputs, (list, tuple)) or isinstance(inputs, Iterator) and not isinstance(inputs, io.IOBase)
    items = list(inputs) if many else [inputs]
    pairs: list[tuple[str, object]] = []
    for index, source in enumerate(items):
        if isinstance(source, Video):
            pairs.append((video_name(source, index), source))
            continue
        source = as_path(source)
        if isinstance(source, (str, Path)) and not is_data_uri(source):
            path = Path(source)
            if _is_dir(path):
                found = _files_under(path) or [path]
                pairs.extend((str(p), p) for p in found)
                continue
        pairs.append((input_name(source, index), source))
    return pairs


def _data_uri_bytes(uri: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep:
        raise ValueError("malformed data URI: expected 'data:<mime type>;base64,<payload>'")
    # The payload is base64 with or without the ";base64" flag, as HF's `load_image` and SGLang's loader read it (a
    # percent-encoded one, which the flag's absence means in RFC 2397, then fails as not base64).
    try:  # whitespace is dropped first: MIME base64 breaks lines every 76 characters, and HF reads it
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"data URI payload is not valid base64 ({e})") from e


def _is_dir(path: Path) -> bool:
    """`path.is_dir()`, False for a path that cannot be looked at (its error is `missing_reason`'s to name)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def missing_reason(path: Path) -> str | None:
    """Why `path` names nothing, or None when it exists."""
    try:
        if path.exists():
            return None
    except OSError as e:  # pathlib lets through what is not "does not exist": a name too long, no permission
        return f"cannot look at the path ({e.strerror or e})"
    return f"broken symbolic link (to {os.readlink(path)})" if path.is_symlink() else "no such file"


def _is_url(source: object) -> bool:
    return isinstance(source, str) and source.startswith(("http://", "https://"))


def _directory_reason(path: Path) -> str:
    """Why a folder, as one input, is no image: it cannot be listed, holds none, or was not expanded."""
    try:
        os.listdir(path)
    except OSError as e:
        return f"cannot list directory ({e.strerror or e})"
    if not _files_under(path):
        exts = ", ".join(sorted(e[1:] for e in _EXTENSIONS))
        return f"directory contains no image or video files ({exts})"
    return "is a directory; expand it with expand_inputs()"


def path_error(name: str, source: object) -> ImageInputError | None:
    """The error a URL, a path that names nothing or a folder will get, found without reading a file (None
    otherwise): lets a caller report inputs certain to fail before it spends time on a model."""
    if _is_url(source):
        return ImageInputError(name, URL_REFUSED)
    if not isinstance(source, (str, os.PathLike)) or is_data_uri(source):
        return None
    path = Path(source)
    reason = missing_reason(path)
    if reason is None and _is_dir(path):
        reason = _directory_reason(path)
    return None if reason is None else ImageInputError(name, reason)


def _read_path(path: Path) -> bytes:
    reason = missing_reason(path)
    if reason is not None:
        raise ValueError(reason)
    if path.is_dir():
        raise ValueError(_directory_reason(path))
    if not path.is_file():
        raise ValueError("not a regular file")
    try:
        with path.open("rb") as f:
            _open(f)  # a file PIL does not take is refused from its header, not after it was read whole
            f.seek(0)
            return f.read()
    except FileNotFoundError as e:  # removed since the check above
        raise ValueError("no such file") from e
    except OSError as e:
        raise ValueError(f"cannot read file ({e.strerror or e})") from e


def check_size(image: Image.Image) -> None:
    """Refuse empty images, and images above PIL's decompression-bomb limit before their pixels are decoded.

    PIL itself only warns between 1x and 2x `Image.MAX_IMAGE_PIXELS`; a server must not decode those.
    """
    check_pixels(image.width, image.height)


def check_pixels(width: int, height: int, what: str = "image") -> None:
    """`check_size` for an image (or a video's frames) known by its size."""
    if width == 0 or height == 0:
        raise ValueError(f"{what} has no pixels ({width}x{height})")
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise ValueError(
            f"{what} of {width}x{height} = {width * height} pixels exceeds the limit of "
            f"{limit} (PIL.Image.MAX_IMAGE_PIXELS, a decompression-bomb guard)"
        )


def _decode(data: bytes) -> Image.Image:
    """Decode encoded image bytes fully (a truncated file fails here, not later)."""
    return _loaded(_open(io.BytesIO(data)))


def _open(stream: BinaryIO) -> Image.Image:
    """PIL's lazy open of an encoded image: its header read and checked (format, size), its pixels not decoded."""
    if not stream.read(1):
        raise ValueError("empty input (0 bytes)")
    stream.seek(0)
    try:
        image = Image.open(stream)
    except Image.DecompressionBombError as e:
        raise ValueError(str(e)) from e
    except Exception as e:  # UnidentifiedImageError mostly; a few plugins raise their own errors
        raise ValueError("not a recognised image format (or a corrupt header)") from e
    check_size(image)
    return image


def _loaded(image: Image.Image) -> Image.Image:
    """`image` with its pixels decoded (PIL opens lazily; a truncated file fails here, not later)."""
    try:
        image.load()
    except Exception as e:  # PIL raises OSError, SyntaxError, EOFError, struct.error... on corrupt data
        raise ValueError(f"corrupt or truncated image data ({type(e).__name__}: {e})") from e
    return image


def _upright(image: Image.Image) -> Image.Image:
    """Apply the EXIF orientation tag, as HF's `load_image` does (`ImageOps.exif_transpose`)."""
    if image.getexif().get(ExifTags.Base.Orientation, 1) == 1:
        return image
    return ImageOps.exif_transpose(image)


def _to_rgb(image: Image.Image) -> Image.Image:
    """HF 5.19 `convert_to_rgb` for PIL images: `.convert("RGB")`, which drops alpha and palette transparency
    (transformers 5.23 composites them onto white instead). An RGB image is returned as is, as HF does."""
    return image if image.mode == "RGB" else image.convert("RGB")


def _from_array(array: np.ndarray) -> Image.Image:
    """uint8 HxW, HxWx3 or HxWx4, always channels last (HF guesses, and misreads e.g. a 3x500x3 array).

    HxWx4 is read as RGBA, the PIL image `Image.fromarray` makes of it, so its alpha is dropped as HF drops a PIL
    image's. (HF 5.19 refuses such an array: its processor cannot tell where the channels are.)
    """
    if array.dtype != np.uint8:
        raise ValueError(f"array dtype must be uint8, got {array.dtype}")
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))) or 0 in array.shape:
        raise ValueError(f"array shape must be HxW, HxWx3 or HxWx4 (channels last), got {array.shape}")
    return Image.fromarray(np.ascontiguousarray(array))


def encoded_bytes(source: object, name: str | None = None) -> bytes | None:
    """The encoded file behind a path, bytes or data URI, read once (so a decode backend can look at it before it
    decodes); None for a source that is pixels already (a PIL image, an array). Errors name the input as
    `load_image`'s do; a file is read only when PIL takes its header, other bytes are not checked here."""
    name = name if name is not None else input_name(source, 0)
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            return bytes(source)
        if is_data_uri(source):
            return _data_uri_bytes(source)
        if _is_url(source):
            return None  # `load_image` says why it is refused
        if isinstance(source, (str, os.PathLike)):
            return _read_path(Path(source))
        return None
    except ValueError as e:
        raise ImageInputError(name, str(e)) from e


def load_image(source: object, name: str | None = None) -> Image.Image:
    """Load one input as an RGB PIL image, or raise `ImageInputError` naming it.

    Accepts a path (str or PathLike), encoded bytes, a base64 `data:` URI, a PIL image or a uint8 array.
    Decodes everything PIL does (JPEG incl. CMYK, PNG incl. palette / 16-bit / alpha, WebP, GIF first
    frame, BMP, TIFF), fully, so truncated files fail here. Images over `PIL.Image.MAX_IMAGE_PIXELS`
    are refused before decoding (arrays excepted: their pixels are already in memory).

    Choices that change pixels, and how they relate to HF transformers 5.19 (which SGLang 0.5.23 pins):
    - EXIF orientation is applied (HF's `load_image` applies `ImageOps.exif_transpose`), to encoded
      inputs and to PIL images alike, so a photo gives the same pixels however it is passed. HF's image
      processor given a PIL image directly does not rotate it; for a PIL image still carrying an
      orientation tag vitjax therefore equals HF on `load_image(img)`, not on `img`.
    - Transparency (an "A" band, a palette's transparent entry) is dropped by `.convert("RGB")`: the pixels
      keep the colour stored under them, as HF's `convert_to_rgb` and `load_image` and SGLang's Qwen3-VL image
      loader give. (transformers 5.23's `convert_to_rgb` composites onto white instead.) RGBA arrays too.
    - 16-bit grayscale ("I;16") goes through Pillow's `.convert("RGB")`, which clips values to 255
      rather than scaling: that is what HF's processor produces, so it is kept for parity.
    The result may be `source` itself when that is already an upright RGB PIL image.
    """
    name = name if name is not None else input_name(source, 0)
    source = as_path(source)
    try:
        if isinstance(source, np.ndarray):
            image = _from_array(source)
        elif isinstance(source, Image.Image):
            check_size(source)
            if getattr(source, "fp", None) is None:  # decoded already
                image = source
            else:  # still reading its file: PIL's load() is not thread-safe, and a request may hold it twice
                with _LAZY_LOAD_LOCK:
                    image = _loaded(source)
        elif isinstance(source, (bytes, bytearray, memoryview)):
            image = _decode(bytes(source))
        elif is_data_uri(source):
            image = _decode(_data_uri_bytes(source))
        elif _is_url(source):
            raise ValueError(URL_REFUSED)
        elif isinstance(source, str) and len(source) > MAX_PATH_CHARS:
            raise ValueError("not a path; an encoded image in a string is a data URI: data:image/<type>;base64,...")
        elif isinstance(source, (str, Path)):
            image = _decode(_read_path(Path(source)))
        else:
            raise ValueError(f"unsupported input type {type(source).__name__}")
        try:
            return _to_rgb(_upright(image))
        except Exception as e:  # a lazily opened PIL image decodes here; odd modes may not convert
            raise ValueError(f"cannot convert to RGB ({type(e).__name__}: {e})") from e
    except ValueError as e:
        raise ImageInputError(name, str(e)) from e
