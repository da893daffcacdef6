"""PyTorch's antialiased bicubic resize of uint8 frames (what torchvision's `resize` runs on the CPU): PyTorch's own
kernel where it is installed and exact, else a numpy repetition of its arithmetic.

HF's video processors resize with `torchvision.transforms.v2.functional.resize(..., BICUBIC, antialias=True)`
on uint8 tensors, which is not PIL's resize: PyTorch (ATen `UpSampleKernel.cpp`, the same numbers in its AVX2
and generic kernels) computes the filter weights in float64 as PIL does (Keys cubic, a = -0.5, widened by
the scale when shrinking, normalised per output pixel), then rounds them to int16 with a precision chosen
per axis from the largest weight, and runs two integer passes, width first, each rounding to uint8
(`(sum + 2^(p-1)) >> p`, clipped). PIL uses a fixed precision, and so differs by a level or two on a few
pixels in a hundred. This module repeats PyTorch's arithmetic exactly. The integer sums run as float64
matrix products over blocks of outputs: every product and partial sum is an integer below 2^53, so BLAS
gives the exact integer whatever its order of summation.

Where PyTorch is installed and its kernel gives these numbers (checked once, on first use, against the numpy
repetition), `resize_bicubic` runs PyTorch's own kernel: the oracle's arithmetic, ~25x faster than the numpy
products on a 12 MP photo. Elsewhere the numpy repetition runs, a bounded number of lines at a time.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

_A = -0.5  # Keys' cubic with a = -0.5, as PIL and PyTorch's antialiased bicubic use
_BLOCK = 32  # outputs per matrix product: each needs only its own span of inputs
_ROWS = 32  # rows per BLAS call: 32 x 32 x span stays under OpenBLAS's threading threshold (2^18) for spans < 256
_CHUNK_VALUES = 1 << 22  # input values per pass at a time: the float64 working copy stays at 32 MB whatever the frame


def _cubic(x: np.ndarray) -> np.ndarray:
    """ATen's `aa_filter` for bicubic, with its operation order (`cubic_convolution1/2`)."""
    x = np.abs(x)
    near = ((_A + 2) * x - (_A + 3)) * x * x + 1
    far = ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=32)
def _blocks(in_size: int, out_size: int) -> tuple[int, tuple[tuple[int, int, int, int, np.ndarray], ...]]:
    """(precision p, blocks (start, stop, lo, hi, int16 weights as float64 [hi - lo, stop - start])) for one axis.

    Follows ATen's `_compute_indices_min_size_weights_aa` and `_compute_index_ranges_int16_weights`, including
    C's truncation toward zero and the sequential sum of the weights.
    """
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size) + 0.5)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)
    xsize = np.clip(np.minimum((center + support + 0.5).astype(np.int64), in_size) - xmin, 0, taps)
    j = np.arange(taps)
    used = j[None] < xsize[:, None]
    w = np.where(used, _cubic(((j[None] + xmin[:, None]) - center[:, None] + 0.5) * invscale), 0.0)
    total = np.zeros(out_size)
    for k in range(taps):  # left to right, as the C loop adds them
        total += w[:, k]
    w = np.divide(w, total[:, None], out=w, where=total[:, None] != 0)
    w_max = w.max()
    p = 0
    while p < 22 and int(0.5 + w_max * (1 << (p + 1))) < (1 << 15):
        p += 1
    v = w * (1 << p)
    k16 = np.trunc(np.where(v < 0, v - 0.5, v + 0.5))
    blocks = []
    for start in range(0, out_size, _BLOCK):
        stop = min(out_size, start + _BLOCK)
        rows, cols = np.nonzero(used[start:stop])
        idx = xmin[start:stop][rows] + cols
        lo, hi = int(idx.min()), int(idx.max()) + 1
        m = np.zeros((hi - lo, stop - start))
        m[idx - lo, rows] = k16[start:stop][rows, cols]
        blocks.append((start, stop, lo, hi, m))
    return p, tuple(blocks)


def _pass(x: np.ndarray, out_size: int) -> np.ndarray:
    """One axis (the last of `x`, float64 `[_ROWS * k, in_size]`) resampled to `out_size`: rounded integers 0..255.

    The products run in batches of `_ROWS` rows, one small BLAS call each: small enough that OpenBLAS keeps
    each on the calling thread (its threads, spinning beside PyAV's decoder threads or beside other frames'
    work, made the same products several times slower), and the caller's threads share the frames.
    """
    rows, in_size = x.shape
    p, blocks = _blocks(in_size, out_size)
    batched = x.reshape(-1, _ROWS, in_size)
    out = np.empty((rows, out_size))
    out_batched = out.reshape(-1, _ROWS, out_size)
    for start, stop, lo, hi, m in blocks:
        np.matmul(batched[:, :, lo:hi], m, out=out_batched[:, :, start:stop])
    # ATen's `(sum + (1 << (p - 1))) >> p`, saturated to uint8; exact in float64 (power-of-two scaling)
    np.add(out, 1 << (p - 1), out=out)
    np.multiply(out, 1.0 / (1 << p), out=out)
    np.floor(out, out=out)
    return np.clip(out, 0, 255, out=out)


def _padded(x: np.ndarray) -> np.ndarray:
    """`x` (any layout, `[..., n]`) as a C-contiguous float64 `[rows, n]` with rows rounded up to `_ROWS`."""
    rows = math.prod(x.shape[:-1])
    out = np.zeros((-(-rows // _ROWS) * _ROWS, x.shape[-1]))
    out[:rows].reshape(x.shape)[...] = x
    return out


def _resample(lines: np.ndarray, out_size: int) -> np.ndarray:
    """uint8 lines `[rows, n]` resampled to `[rows, out_size]`, a chunk of lines at a time (a 24 MP photo's float64
    copy alone would be 600 MB)."""
    rows, in_size = lines.shape
    chunk = max(_ROWS, _CHUNK_VALUES // in_size // _ROWS * _ROWS)
    out = np.empty((rows, out_size), np.uint8)
    for start in range(0, rows, chunk):
        part = lines[start : start + chunk]
        out[start : start + len(part)] = _pass(_padded(part), out_size)[: len(part)]
    return out


def numpy_bicubic(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """`resize_bicubic` by the numpy repetition of PyTorch's arithmetic (frames already checked)."""
    *lead, in_h, in_w, channels = frames.shape
    n = math.prod(lead)
    x = frames.reshape(n, in_h, in_w, channels)
    if in_w != width:  # along rows first, as PyTorch does
        lines = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).reshape(-1, in_w)
        x = _resample(lines, width).reshape(n, in_h, channels, width).transpose(0, 1, 3, 2)  # [n, H, width, C]
    if in_h != height:
        lines = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(-1, in_h)
        x = _resample(lines, height).reshape(n, width, channels, height).transpose(0, 3, 1, 2)  # [n, height, width, C]
    return np.ascontiguousarray(x).reshape(*lead, height, width, channels)


def torch_bicubic(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """`resize_bicubic` by PyTorch's kernel, as torchvision calls it for uint8 tensors (frames already checked)."""
    import torch

    *lead, in_h, in_w, channels = frames.shape
    if not frames.flags.writeable or min(frames.strides) < 0:  # torch.from_numpy warns on read-only memory (PIL's
        frames = frames.copy()  # arrays are) and refuses negative strides (a flipped view)
    x = torch.from_numpy(frames.reshape(-1, in_h, in_w, channels)).permute(0, 3, 1, 2)  # NCHW over NHWC memory
    out = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return np.ascontiguousarray(out.permute(0, 2, 3, 1).numpy()).reshape(*lead, height, width, channels)


_torch_checked: bool | None = None
_torch_lock = threading.Lock()


def torch_is_exact() -> bool:
    """Whether PyTorch is installed and its kernel gives the numpy repetition's numbers: checked once, on a frame
    of noise shrunk, enlarged and both (a PyTorch without the uint8 kernel, which resized in float, fails it)."""
    global _torch_checked
    if _torch_checked is None:  # every resize asks: once decided, without taking the lock the resize threads share
        with _torch_lock:
            if _torch_checked is None:
                _torch_checked = _torch_agrees()
    return _torch_checked


def _torch_agrees() -> bool:
    try:
        import torch  # noqa: F401
    except Exception:  # not installed, or broken (a CUDA build missing its libraries raises OSError): numpy then
        return False
    frame = np.random.default_rng(0).integers(0, 256, (2, 61, 83, 3), dtype=np.uint8)
    try:
        return all(
            np.array_equal(torch_bicubic(frame, h, w), numpy_bicubic(frame, h, w))
            for h, w in [(32, 32), (160, 224), (96, 41), (61, 200)]
        )
    except Exception:  # a PyTorch that refuses uint8 bicubic with antialiasing
        return False


def resize_bicubic(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 frames `[..., H, W, C]` -> `[..., height, width, C]`, bit-identical to torchvision's
    `resize(frames_as_NCHW, [height, width], InterpolationMode.BICUBIC, antialias=True)` on the CPU.

    An axis whose size does not change is not resampled, as in PyTorch. Runs PyTorch's kernel where
    `torch_is_exact()`, else the numpy repetition.
    """
    if frames.dtype != np.uint8 or frames.ndim < 3:
        raise ValueError(f"frames must be a uint8 array [..., H, W, C], got {frames.dtype} {list(frames.shape)}")
    if frames.shape[-3:-1] == (height, width):
        return frames
    return (torch_bicubic if torch_is_exact() else numpy_bicubic)(frames, height, width)
