"""Qwen3-VL image preprocessing on the CPU, bit-identical to HF transformers 5.23.

The oracle is `transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil` with
the Qwen3-VL settings (patch 16, merge 2, temporal 2, mean = std = 0.5, 65,536..16,777,216 pixels,
bicubic, convert to RGB). Its steps: `smart_resize`; PIL bicubic resize on uint8; rescale as
`float32(float64(u8) * (1/255))`; normalize `(x - 0.5) / 0.5` in float32; patchify in merge-window order
with the frame repeated `temporal_patch_size` times. Rescale and normalize depend only on the uint8 value,
so they are one lookup in a 256-entry table computed with HF's exact arithmetic: bit-identical by
construction, and cheaper than float math on every value.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from PIL import Image

from vitjax.images import ImageInputError, input_name, load_image

MAX_ASPECT_RATIO = 200
# Qwen3-VL's preprocessor_config.json: shortest_edge / longest_edge, in pixels of area.
MIN_PIXELS, MAX_PIXELS = 65536, 16777216
IMAGE_MEAN = IMAGE_STD = 0.5


def smart_resize(
    height: int, width: int, factor: int = 32, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> tuple[int, int]:
    """HF's `smart_resize`: sides become multiples of `factor`, the area lands in [min_pixels, max_pixels].

    Uses Python's `round` (half to even: 272/32 = 8.5 rounds to 256) exactly as HF does.
    """
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio {ratio:.4g} ({height}x{width}, height x width) exceeds the limit of "
            f"{MAX_ASPECT_RATIO} that Qwen-VL preprocessing accepts"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _normalized_table() -> np.ndarray:
    """float32 value of every uint8 level after HF's rescale then normalize, in HF's dtype sequence."""
    rescaled = (np.arange(256, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)
    mean, std = np.float32(IMAGE_MEAN), np.float32(IMAGE_STD)
    return (rescaled - mean) / std


_TABLE = _normalized_table()
# bfloat16 rows are HF's float32 values rounded once, as HF's model does to pixel_values before its conv.
_TABLES = {np.dtype(np.float32): _TABLE, np.dtype(ml_dtypes.bfloat16): _TABLE.astype(ml_dtypes.bfloat16)}


def preprocess_image(
    image: object,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    *,
    patch_size: int = 16,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    name: str | None = None,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One image (anything `load_image` accepts) -> (pixel_values [h*w, 3*T*P*P] float32, grid_thw [1, 3]).

    Rows are patches in merge-window order; columns are (channel, temporal, row, col) of the patch, the
    image repeated over the temporal axis. Errors (undecodable input, aspect ratio over 200) are
    `ImageInputError`s naming the input (`name`, else as `load_image` names it). With `out` (a C-contiguous
    float32 or bfloat16 array of exactly that shape, e.g. rows of a batch buffer) the rows are written there;
    bfloat16 rows are the float32 ones rounded, which is what a bf16 tower does to its input anyway.
    """
    name = name if name is not None else input_name(image)
    rgb = load_image(image, name)
    height, width = resized_size(rgb, min_pixels, max_pixels, patch_size * merge_size, name)
    pixels = np.asarray(rgb.resize((width, height), Image.Resampling.BICUBIC))  # (H, W, 3) uint8
    grid_h, grid_w = height // patch_size, width // patch_size
    m, p = merge_size, patch_size
    # (bh, mh, ph, bw, mw, pw, C) -> (bh, bw, mh, mw, C, ph, pw): merge-window order, channels first
    windows = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    levels = np.ascontiguousarray(windows).reshape(grid_h * grid_w, 3, 1, p * p)
    shape = (grid_h * grid_w, 3 * temporal_patch_size * p * p)
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.shape != shape or out.dtype not in _TABLES or not out.flags.c_contiguous:
        raise ValueError(
            f"out must be a C-contiguous float32 or bfloat16 array of shape {list(shape)}, "
            f"got {out.dtype} {list(out.shape)}"
        )
    frame = np.take(_TABLES[out.dtype], levels, mode="clip")  # uint8 indices are always in range
    out.reshape(grid_h * grid_w, 3, temporal_patch_size, p * p)[...] = frame
    return out, np.array([[1, grid_h, grid_w]], dtype=np.int64)


def resized_size(
    image: Image.Image, min_pixels: int, max_pixels: int, factor: int = 32, name: str = ""
) -> tuple[int, int]:
    """(height, width) `preprocess_image` resizes `image` to; an aspect-ratio error names the input."""
    try:
        return smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
    except ValueError as e:
        raise ImageInputError(name or input_name(image), str(e)) from e
