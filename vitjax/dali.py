"""NVIDIA DALI: encoded images -> patch rows in one DALI pipeline run per batch; DALI is imported here only, lazily.

On a GPU the JPEGs are decoded by nvJPEG (the hardware JPEG decoder where the chip has one, `hw_decoder_load`
of each batch) and the rows never visit the host: DALI's batch is handed to JAX through DLPack. Without a GPU the
same graph runs on DALI's CPU backend (libjpeg-turbo, bit-identical to PIL's decode) into a host array.

The graph: decode (EXIF orientation applied) -> bicubic, antialiased resize to the size `smart_resize` gave, as
two one-axis passes in Pillow's order with uint8 between them, as Pillow does -> the patch rows in merge-window
order (reshape, transpose, the frame repeated over the temporal axis) -> rescale and normalize by the same
256-entry table as `vitjax.preprocess` (exact per uint8 level). Only the resize differs from PIL's: DALI filters in
float where Pillow uses 22-bit fixed point (at most 1 level apart inside the image), and DALI clamps at the borders
where Pillow renormalizes the cut kernel (a few levels apart in the outer 2-3 pixels, more on noise). A sample of
the "torchvision" image processor backend is resized width first, as PyTorch does, and normalized by that
processor's table (`vitjax.preprocess`), with the same kind of differences from its rows.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import PIL

from vitjax.config import VisionConfig
from vitjax.preprocess import TABLES

# DALI's default share of a batch for the hardware JPEG decoder (the rest goes to nvJPEG's CUDA decoder).
HW_DECODER_LOAD = 0.65
# Pillow 13 resizes vertically first when the height shrinks by more than twice as many pixels as the width.
_PILLOW_VERTICAL_FIRST = int(PIL.__version__.split(".")[0]) >= 13


def available() -> bool:
    """Whether NVIDIA DALI is installed (`pip install vitjax[dali]`), without importing it."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no `nvidia` namespace package at all
        return False


def first_pass(decoded: tuple[int, int], size: tuple[int, int], processor: str = "pil") -> tuple[int, int]:
    """(height, width) after the first resize pass from `decoded` to `size`: PyTorch's ("torchvision") is the width;
    Pillow's (checked against the installed Pillow in the tests) the height when it shrinks by more than twice as
    many pixels as the width, else the width."""
    (height, width), (out_h, out_w) = decoded, size
    if processor == "pil" and _PILLOW_VERTICAL_FIRST and out_h < height and height - out_h > 2 * (width - out_w):
        return out_h, width
    return height, out_w


@dataclass(frozen=True)
class Sample:
    """One image for DALI: its encoded bytes, its size once decoded and upright, and the size of its rows."""

    data: np.ndarray  # uint8 [n]: a JPEG, or a PPM of pixels PIL already decoded and resized
    decoded: tuple[int, int]  # (height, width)
    size: tuple[int, int]  # (height, width), multiples of patch_size * merge_size
    processor: str = "pil"  # the image processor backend whose resize order and normalization the rows follow

    @classmethod
    def of_pixels(cls, rgb: bytes, height: int, width: int, processor: str = "pil") -> Sample:
        """Pixels already decoded and resized (RGB, row-major): a PPM, which DALI's decode and resize leave as is."""
        data = np.frombuffer(f"P6 {width} {height} 255\n".encode() + rgb, np.uint8)
        return cls(data, (height, width), (height, width), processor)


class DaliRows:
    """Samples -> their patch rows `[sum of h*w, patch_dim]` float32, concatenated in order, in one DALI run.

    On `device` when it is a GPU (a `jax.Array` there), else on the host (numpy). The built DALI pipeline is kept
    and reused (it grows when a batch is larger than any before); runs are serialized. A batch DALI cannot decode
    raises (DALI fails whole batches); `run_each` then finds which samples fail.
    """

    def __init__(
        self,
        cfg: VisionConfig,
        device: jax.Device | None = None,
        *,
        threads: int | None = None,
        hw_decoder_load: float = HW_DECODER_LOAD,
    ):
        self.cfg = cfg
        self.device = device if device is not None and device.platform == "gpu" else None
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.hw_decoder_load = hw_decoder_load
        self._pipe = None
        self._max_batch = 0
        self._lock = threading.Lock()

    def __call__(self, samples: list[Sample]) -> np.ndarray | jax.Array:
        with self._lock:
            try:
                return self._run(samples)
            except RuntimeError:
                self._pipe = None  # DALI's pipeline is no longer valid after a failed run: build a fresh one
                raise

    def run_each(self, samples: list[Sample]) -> list[bool]:
        """Whether each sample decodes when run alone (DALI's error names no sample; its decoder logs the reason)."""
        decodes = []
        for sample in samples:
            try:
                self([sample])
                decodes.append(True)
            except RuntimeError:
                decodes.append(False)
        return decodes

    def _run(self, samples: list[Sample]) -> np.ndarray | jax.Array:
        p, m = self.cfg.patch_size, self.cfg.spatial_merge_size
        pipe = self._pipeline(len(samples))
        sizes = [s.size for s in samples]
        pipe.feed_input("data", [s.data for s in samples])
        firsts = [first_pass(s.decoded, s.size, s.processor) for s in samples]
        pipe.feed_input("first", [np.array(first, np.float32) for first in firsts])
        pipe.feed_input("size", [np.array(size, np.float32) for size in sizes])
        pipe.feed_input("r1", [np.array(f != s.decoded) for f, s in zip(firsts, samples, strict=True)])
        pipe.feed_input("r2", [np.array(f != s.size) for f, s in zip(firsts, samples, strict=True)])
        pipe.feed_input("windows", [np.array([h // p // m, m, p, w // p // m, m, p, 3], np.int32) for h, w in sizes])
        pipe.feed_input("patches", [np.array([h * w // (p * p), 3, 1, p * p], np.int32) for h, w in sizes])
        pipe.feed_input("tv", [np.array(s.processor == "torchvision") for s in samples])
        (out,) = pipe.run()
        shape = [sum(h * w for h, w in sizes) // (p * p), self.cfg.patch_dim]
        if self.device is None:
            rows = np.empty(shape, np.float32)
            out.copy_to_external(ctypes.c_void_p(rows.ctypes.data))
            return rows
        try:  # one contiguous batch, the usual case: JAX takes DALI's memory through DLPack, no copy (DALI's
            # dynamic executor never reuses an output that a capsule still holds)
            return jax.dlpack.from_dlpack(out.as_reshaped_tensor(shape), device=self.device)
        except RuntimeError:  # DALI does not promise contiguity: copy the samples into a buffer of JAX's own
            rows = jnp.zeros(shape, jnp.float32, device=self.device).block_until_ready()
            out.copy_to_external(ctypes.c_void_p(rows.unsafe_buffer_pointer()), non_blocking=False)
            return rows

    def _pipeline(self, batch: int):
        if batch > self._max_batch:  # grows by doubling; a failed run only rebuilds it at its size
            self._max_batch, self._pipe = max(batch, 2 * self._max_batch), None
        if self._pipe is None:
            self._pipe = self._build(self._max_batch)
        return self._pipe

    def _build(self, max_batch: int):
        from nvidia.dali import fn, pipeline_def, types

        t = self.cfg.temporal_patch_size
        if self.device is None:
            decode = {"device": "cpu"}
        else:
            decode = {"device": "mixed", "hw_decoder_load": self.hw_decoder_load}

        levels, tables = list(range(256)), {name: table.tolist() for name, table in TABLES.items()}

        @pipeline_def(
            batch_size=max_batch,
            num_threads=self.threads,
            device_id=None if self.device is None else self.device.local_hardware_id,
            prefetch_queue_depth=1,
            exec_dynamic=True,
            enable_conditionals=True,
        )
        def rows():
            data = fn.external_source(name="data", dtype=types.UINT8, ndim=1)
            first, size = (fn.external_source(name=n, dtype=types.FLOAT, ndim=1) for n in ("first", "size"))
            windows, patches = (fn.external_source(name=n, dtype=types.INT32, ndim=1) for n in ("windows", "patches"))
            resize_first, resize_second, torchvision = (
                fn.external_source(name=n, dtype=types.BOOL, ndim=0) for n in ("r1", "r2", "tv")
            )
            image = fn.decoders.image(data, output_type=types.RGB, **decode)
            # One axis per pass, rounded to uint8 in between, as Pillow and PyTorch do; a pass that keeps the size is
            # skipped per sample (DALI would still filter: a second per 20 photos on two CPU cores).
            if resize_first:
                image = fn.resize(image, size=first, interp_type=types.INTERP_CUBIC, antialias=True)
            if resize_second:
                image = fn.resize(image, size=size, interp_type=types.INTERP_CUBIC, antialias=True)
            x = fn.reshape(image, shape=windows)  # (bh, m, p, bw, m, p, C)
            x = fn.transpose(x, perm=[0, 3, 1, 4, 6, 2, 5])  # (bh, bw, m, m, C, p, p): merge-window order
            x = fn.reshape(x, shape=patches)  # (patches, C, 1, p*p)
            if torchvision:  # the image processor backend's table
                x = fn.lookup_table(x, keys=levels, values=tables["torchvision"], dtype=types.FLOAT)
            else:
                x = fn.lookup_table(x, keys=levels, values=tables["pil"], dtype=types.FLOAT)
            return fn.cat(*[x] * t, axis=2) if t > 1 else x  # the still frame repeated over the temporal axis

        pipe = rows()
        pipe.build()
        return pipe
