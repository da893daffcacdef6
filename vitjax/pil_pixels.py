"""An RGB PIL image's pixels as a numpy array without `Image.tobytes`, which preprocessing threads queue on.

`np.asarray(image)` and `image.tobytes()` copy the pixels out through Pillow's raw encoder in 64 KB pieces, a loop
that holds Python's lock. On a 64-core host that copy stopped scaling at two threads (~1.5 ms an image for a
960x1280 photo, whatever the thread count), and a photo took two of them (its digest, then its rows), so the
pipeline's preprocessing topped out near 5 ms an image (`bench/NOTES.md`). Pillow (11.2 and later) also exports an
image's memory through the Arrow C data interface (`Image.__arrow_c_array__`): a view of it costs nothing, and the
copies that follow (numpy's, hashlib's) let go of the lock. Pillow keeps an RGB pixel in 4 bytes (RGBX), so the view
is a strided [height, width, 3] slice of [height, width, 4]. An image Pillow holds in several blocks (larger than its
16 MiB block: above ~4 MP in RGB) cannot be exported in one piece, and an older Pillow has no export: both take
`np.asarray`, the same pixels. Pillow before 13 also exports an image whose rows it padded (`PILLOW_ALIGNMENT` above
4 bytes) as if they were not, so there the export is read only while the alignment is 1, 2 or 4, under which a
4-byte pixel's rows are never padded (Pillow 13 refuses padded rows itself). What that cannot see, on Pillow 11.2 to
12: an image allocated while a larger alignment was set at runtime, then viewed after it was set back.
"""

from __future__ import annotations

import ctypes

import numpy as np
import PIL
from PIL import Image

from vitjax.capsules import capsule_pointer


class _ArrowArray(ctypes.Structure):
    """`struct ArrowArray` of the Arrow C data interface (a stable ABI: arrow.apache.org/docs/format/CDataInterface)."""


_ArrowArray._fields_ = [
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]


_PILLOW_13 = int(PIL.__version__.split(".")[0]) >= 13


def _rows_unpadded() -> bool:
    """Whether Pillow's export can be read as one run of rows (see the module's docstring)."""
    return _PILLOW_13 or getattr(Image.core, "get_alignment", lambda: 1)() in (1, 2, 4)


class _Exported:
    """Numpy's base for a view of an image's memory: holds the image and its Arrow export while the view lives."""

    def __init__(self, image: Image.Image, export: tuple, address: int):
        self._image, self._export = image, export
        shape = (image.height, image.width, 4)
        self.__array_interface__ = {"version": 3, "shape": shape, "typestr": "|u1", "data": (address, True)}


def rgb_pixels(image: Image.Image) -> np.ndarray:
    """`np.asarray(image)` for an RGB image, [height, width, 3] uint8 (read-only): a view of Pillow's memory where
    Pillow exports it in one piece (checked on Pillow 11.3, 12.3 and 13.0), else numpy's copy. A view, not a
    snapshot: edits made to the image in place afterwards (`paste`, `putpixel`) show through it."""
    if image.mode != "RGB":
        raise ValueError(f"rgb_pixels takes RGB images, not {image.mode}")
    if not _rows_unpadded():
        return np.asarray(image)
    try:
        export = image.__arrow_c_array__()
    except (AttributeError, ValueError):  # Pillow < 11.2; an image in several blocks ("rows are not contiguous")
        return np.asarray(image)
    array = _ArrowArray.from_address(capsule_pointer(export[1], b"arrow_array"))
    # One fixed-size list of 4 uint8 per pixel (schema "+w:4" of "C"): the bytes are its one child's data buffer.
    if array.n_children != 1 or array.length != image.width * image.height or array.offset:
        return np.asarray(image)
    pixels = array.children[0].contents
    if pixels.length != 4 * array.length or pixels.offset or pixels.n_buffers != 2 or not pixels.buffers[1]:
        return np.asarray(image)
    view = np.asarray(_Exported(image, export, pixels.buffers[1]))
    return view[..., :3]


def rgb_bytes(image: Image.Image) -> np.ndarray:
    """`image.tobytes()`'s bytes for an RGB image, as a C-contiguous [height, width, 3] uint8 array made without
    holding Python's lock (for hashing)."""
    pixels = rgb_pixels(image)
    if pixels.flags.c_contiguous:
        return pixels
    packed = np.empty(pixels.shape, np.uint8)
    for channel in range(3):  # a channel at a time: numpy's copy of 3-byte runs at a stride of 4 is ~4x slower
        packed[..., channel] = pixels[..., channel]
    return packed
