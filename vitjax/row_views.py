"""Zero-copy row views of a device array: the per-image outputs of a packed tower call and the chunks of
device-resident pixels, taken without a compile per row count (see `row_view`)."""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Iterable
from typing import NamedTuple

import jax

from vitjax.capsules import capsule_pointer
from vitjax.notices import notice_once


class _DLTensor(ctypes.Structure):
    """DLPack's `DLTensor` (a stable C ABI) followed by `DLManagedTensor`'s two pointers."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", ctypes.c_int32 * 2),
        ("ndim", ctypes.c_int32),
        ("dtype", ctypes.c_uint8 * 4),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


# Buffers handed to XLA must stay aligned: a view starting elsewhere is copied (by the runtime, no compile).
_VIEW_ALIGN = 256


def _cut_rows(capsule: object, array: jax.Array, start: int, rows: int) -> object:
    """Point a DLPack capsule of the whole `array` at rows [start, start+rows) only."""
    tensor = _DLTensor.from_address(capsule_pointer(capsule, b"dltensor"))
    tensor.data += start * math.prod(array.shape[1:]) * array.dtype.itemsize
    tensor.shape[0] = rows
    return capsule


class _Rows:
    """A DLPack producer for rows [start, start+rows) of a row-major device array: JAX's own capsule of the
    whole array with its data pointer advanced and its row count cut. The capsule keeps the parent buffer
    alive until the view is freed."""

    def __init__(self, array: jax.Array, start: int, rows: int):
        self.array, self.start, self.rows = array, start, rows

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, stream=None, **_):
        return _cut_rows(self.array.__dlpack__(stream=stream), self.array, self.start, self.rows)


try:  # JAX's private DLPack entry points, for `_import_rows` alone (same signatures in jax 0.10.2 and 0.11.2)
    from jax._src.lib import _jax as _jaxlib

    _to_capsule, _from_capsule = _jaxlib.buffer_to_dlpack_managed_tensor, _jaxlib.dlpack_managed_tensor_to_buffer
except (ImportError, AttributeError):
    _to_capsule = _from_capsule = None


@functools.cache
def _ready_stream(device: jax.Device) -> int | None:
    """The stream a view's readiness is ordered on, as `jax.dlpack.from_dlpack` picks it (only GPUs have one)."""
    try:
        return device.get_stream_for_external_ready_events()
    except jax.errors.JaxRuntimeError:
        return None


class _Importer(NamedTuple):
    """What every view of one array shares: its buffer, device, ready stream and DLPack device type."""

    buffer: jax.Array
    device: jax.Device
    stream: int | None
    dlpack_type: int


def _importer(array: jax.Array) -> _Importer | None:
    """The per-array half of `_import_rows`, or None where JAX's private entry points are missing or the array
    spans several devices."""
    devices = array.devices()
    if _from_capsule is None or len(devices) != 1:
        return None
    (device,) = devices
    return _Importer(array.addressable_data(0), device, _ready_stream(device), int(array.__dlpack_device__()[0]))


def _import_rows(array: jax.Array, start: int, rows: int, importer: _Importer | None = None) -> jax.Array | None:
    """Rows of a one-device array as an array on its memory, through JAX's private DLPack entry points, or None
    where they are missing or refuse. The public `jax.dlpack.from_dlpack` spends ~94 µs a view on lookups and an
    array wrap, paid before a call starts for each of its device-resident pixel chunks (bench/NOTES.md)."""
    importer = importer or _importer(array)
    if importer is None:
        return None
    try:
        capsule = _cut_rows(_to_capsule(importer.buffer, stream=importer.stream), array, start, rows)
        return _from_capsule(capsule, importer.device, importer.stream, None, importer.dlpack_type)
    except Exception:  # what this runtime refuses here, the public path may still take
        return None


def row_view(array: jax.Array, start: int, rows: int, importer: _Importer | None = None) -> jax.Array:
    """Rows [start, start+rows) of a 2-D device array without a compilation, and without a copy when aligned.

    A compiled slice would be specialized to the row count, i.e. compiled once per image size; this view
    shares the parent's memory (JAX arrays are immutable, so sharing is safe). Rows that start off the
    alignment XLA expects (only with unusual output widths) are copied by the runtime instead; a platform
    that refuses DLPack gets the compiled slice. Aligned views are made through JAX's private DLPack entry
    points where this JAX has them (`_import_rows`, ~5x cheaper on the host), else through the public one.
    """
    if start == 0 and rows == array.shape[0]:
        return array
    aligned = (start * math.prod(array.shape[1:]) * array.dtype.itemsize) % _VIEW_ALIGN == 0
    try:
        view = _import_rows(array, start, rows, importer) if aligned else None
        if view is None:
            # DLPack names CPU memory as device 0 whichever CPU device holds it: say where the view belongs (a
            # view of CPU device 1's array is then copied there; GPU views stay zero-copy).
            copy = None if aligned else True
            view = jax.dlpack.from_dlpack(_Rows(array, start, rows), device=array.sharding, copy=copy)
        return view
    except Exception as e:  # any refusal: slice instead
        notice_once(__name__, f"zero-copy row views unavailable ({e}); slicing per image size instead")
    return _slice_rows(array, start, rows)


def row_views(array: jax.Array, spans: Iterable[tuple[int, int]]) -> list[jax.Array]:
    """`row_view` of each (start, rows) span of one array, its per-array lookups made once: a call's device-resident
    pixel chunks (47 for 20 photos) and its per-image outputs are taken before or right after the device work."""
    importer = _importer(array)
    return [row_view(array, start, rows, importer) for start, rows in spans]


@functools.partial(jax.jit, static_argnums=2)
def _slice_rows(array: jax.Array, start: int, rows: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(array, start, rows)
