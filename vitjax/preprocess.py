"""Qwen3-VL image and video preprocessing on the CPU, bit-identical to HF transformers 5.x.

The oracle is `transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil` with
the Qwen3-VL settings (patch 16, merge 2, temporal 2, mean = std = 0.5, 65,536..16,777,216 pixels,
bicubic, convert to RGB). Its steps: `smart_resize`; PIL bicubic resize on uint8; rescale as
`float32(float64(u8) * (1/255))`; normalize `(x - 0.5) / 0.5` in float32; patchify in merge-window order
with the frame repeated `temporal_patch_size` times. Rescale and normalize depend only on the uint8 value,
so they are one lookup in a 256-entry table computed with HF's exact arithmetic: bit-identical by
construction, and cheaper than float math on every value.

`backend="torchvision"` follows HF's other image processor instead, `Qwen2VLImageProcessor`: the one
`AutoProcessor` builds in transformers 5, run on the CPU (a SGLang server without CUDA gets these rows; one on a
GPU decodes and resizes there, and its rows differ: README). It
resizes with torchvision's uint8 bicubic (`vitjax.resize`, exact) and normalizes as the video processor does
(below); its rows differ from the PIL processor's by up to ~11 levels where the image is resized, and by an
ulp on some values even where it is not.

Videos follow `transformers.models.qwen3_vl.video_processing_qwen3_vl.Qwen3VLVideoProcessor` with its
defaults: frames sampled as `vitjax.video` says; one size for all frames from the video `smart_resize`
(the pixel budget counts every frame) after the per-frame cap of the reference implementation
(qwen-vl-utils, HF's `cap_pixels_per_frame=True`, its default from transformers 5.22); torchvision's uint8
bicubic resize (`vitjax.resize`, exact); HF's fused rescale+normalize `(x - 127.5) / 127.5` in float32
(a few values differ from the image table by an ulp); frames paired along time, the last one repeated
when the count is odd.
"""

from __future__ import annotations

import math
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import ml_dtypes
import numpy as np
from PIL import Image

from vitjax.checks import is_int, is_number, is_positive
from vitjax.images import ImageInputError, input_name, load_image
from vitjax.pil_pixels import rgb_pixels
from vitjax.resize import resize_bicubic
from vitjax.video import MAX_FRAMES, MIN_FRAMES, Clip, Video, VideoInputError, check_frame_bounds, open_clip

MAX_ASPECT_RATIO = 200
# Qwen3-VL's preprocessor_config.json: shortest_edge / longest_edge, in pixels of area.
MIN_PIXELS, MAX_PIXELS = 65536, 16777216
IMAGE_MEAN = IMAGE_STD = 0.5
# Qwen3VLVideoProcessor.size: shortest_edge / longest_edge, in pixels summed over all frames; and its
# per-frame cap in tokens of 32x32 pixels (`max_video_tokens`).
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 32 * 32, 768 * 32 * 32
MAX_VIDEO_TOKENS = 768
# Threads resizing one video's temporal groups while its frames are decoded.
RESIZE_THREADS = min(4, os.cpu_count() or 1)


def smart_resize(
    height: int, width: int, factor: int = 32, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> tuple[int, int]:
    """HF's `smart_resize`: sides become multiples of `factor`, the area lands in [min_pixels, max_pixels] (a little
    outside where the two are close, or above max_pixels at extreme aspect ratios: HF's rounding, kept).

    Uses Python's `round` (half to even: 272/32 = 8.5 rounds to 256) exactly as HF does.
    """
    return _fit(height, width, factor, min_pixels, max_pixels)


def _fit(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1, t_bar: int = 1
) -> tuple[int, int]:
    """The shared core of HF's image and video `smart_resize`: the aspect-ratio limit, sides rounded (half to
    even) to multiples of `factor`, then the area (times `t_bar` rounded frames; `frames` real ones) scaled
    into [min_pixels, max_pixels]."""
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio {ratio:.4g} ({height}x{width}, height x width) exceeds the limit of "
            f"{MAX_ASPECT_RATIO} that Qwen-VL preprocessing accepts"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _pil_table() -> np.ndarray:
    """float32 value of every uint8 level after HF's rescale then normalize, in HF's dtype sequence."""
    rescaled = (np.arange(256, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)
    mean, std = np.float32(IMAGE_MEAN), np.float32(IMAGE_STD)
    return (rescaled - mean) / std


def _torchvision_table() -> np.ndarray:
    """The same for HF's torchvision processors (video, and images with backend "torchvision"): they fold the
    rescale into mean and std (127.5 each, float32) and run torchvision's `normalize`, `(x - mean) / std` in
    float32."""
    scaled = np.float32(IMAGE_MEAN * 255)
    return (np.arange(256, dtype=np.float32) - scaled) / np.float32(IMAGE_STD * 255)


def _tables(table: np.ndarray) -> dict[np.dtype, np.ndarray]:
    # bfloat16 rows are HF's float32 values rounded once, as HF's model does to pixel_values before its conv.
    return {np.dtype(np.float32): table, np.dtype(ml_dtypes.bfloat16): table.astype(ml_dtypes.bfloat16)}


# The float32 value of every uint8 level in the rows of each image processor backend (videos: "torchvision").
TABLES = {"pil": _pil_table(), "torchvision": _torchvision_table()}
_ROW_TABLES = {backend: _tables(table) for backend, table in TABLES.items()}  # by backend, then by row dtype
# Rows of this dtype hold the levels themselves, before the table: a quarter of float32's bytes and no lookup on the
# host. `vitjax.engine` maps them on the device, for 16-bit towers only: rounded to 16 bits the two tables agree.
LEVELS = np.dtype(np.uint8)
LEVEL_TOWERS = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))  # where the tables agree
# HF's image processors for Qwen-VL, by their `backend`: `Qwen2VLImageProcessorPil` and `Qwen2VLImageProcessor`.
IMAGE_PROCESSOR_BACKENDS = tuple(TABLES)
BACKEND_CHOICES = f"must be one of {', '.join(map(repr, IMAGE_PROCESSOR_BACKENDS))} (HF's image processors)"


def _output(out: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    """`out` checked against the rows' shape, or a new float32 array."""
    if out is None:
        return np.empty(shape, np.float32)
    if (
        out.shape != shape
        or (out.dtype not in _ROW_TABLES["pil"] and out.dtype != LEVELS)
        or not out.flags.c_contiguous
    ):
        raise ValueError(
            f"out must be a C-contiguous float32, bfloat16 or uint8 (levels) array of shape {list(shape)}, "
            f"got {out.dtype} {list(out.shape)}"
        )
    return out


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
    backend: str = "pil",
) -> tuple[np.ndarray, np.ndarray]:
    """One image (anything `load_image` accepts) -> (pixel_values [h*w, 3*T*P*P] float32, grid_thw [1, 3]).

    Rows are patches in merge-window order; columns are (channel, temporal, row, col) of the patch, the
    image repeated over the temporal axis. Errors (undecodable input, aspect ratio over 200) are
    `ImageInputError`s naming the input (`name`, else as `load_image` names it). With `out` (a C-contiguous
    float32, bfloat16 or uint8 array of exactly that shape, e.g. rows of a batch buffer) the rows are written there;
    bfloat16 rows are the float32 ones rounded, which is what a bf16 tower does to its input anyway; uint8 rows
    (`LEVELS`) are the levels before HF's rescale and normalize (`TABLES`).
    `backend` names the HF processor the rows equal (`IMAGE_PROCESSOR_BACKENDS`): "pil" or "torchvision",
    each given the image `load_image` gives (decoded, upright, RGB).
    """
    check_pixel_bounds(min_pixels, max_pixels)
    check_geometry(patch_size, merge_size, temporal_patch_size)
    check_backend(backend)
    name = name if name is not None else input_name(image)
    rgb = load_image(image, name)
    height, width = resized_size(rgb, min_pixels, max_pixels, patch_size * merge_size, name)
    pixels = resized_pixels(rgb, height, width, backend)
    grid_h, grid_w = height // patch_size, width // patch_size
    m, p = merge_size, patch_size
    # (bh, mh, ph, bw, mw, pw, C) -> (bh, bw, mh, mw, C, ph, pw): merge-window order, channels first
    windows = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    levels = np.ascontiguousarray(windows).reshape(grid_h * grid_w, 3, 1, p * p)
    out = _output(out, (grid_h * grid_w, 3 * temporal_patch_size * p * p))
    if out.dtype != LEVELS:
        levels = np.take(_ROW_TABLES[backend][out.dtype], levels, mode="clip")  # uint8 indices are always in range
    out.reshape(grid_h * grid_w, 3, temporal_patch_size, p * p)[...] = levels
    return out, np.array([[1, grid_h, grid_w]], dtype=np.int64)


def resized_pixels(image: Image.Image, height: int, width: int, backend: str = "pil") -> np.ndarray:
    """An RGB image resized as `backend`'s processor resizes it: uint8 (height, width, 3), read-only: a view of a PIL
    image's memory where `rgb_pixels` can, `image`'s own when no resize is needed (so use it before editing `image`)."""
    if backend == "pil":  # Pillow's resize to the same size is a copy
        same = image.size == (width, height)
        return rgb_pixels(image if same else image.resize((width, height), Image.Resampling.BICUBIC))
    return resize_bicubic(rgb_pixels(image), height, width)


def check_backend(backend: str, setting: str = "backend") -> None:
    """Refuse an image processor backend vitjax does not follow, before any input is read (`setting`: its name)."""
    if backend not in IMAGE_PROCESSOR_BACKENDS:
        raise ValueError(f"{setting} {BACKEND_CHOICES}, got {backend!r}")


def check_pixel_bounds(min_pixels: int, max_pixels: int) -> None:
    """Refuse bounds no resize can meet, before any input is read (else they would surface as each input's error)."""
    if not (is_positive(min_pixels) and is_number(max_pixels) and 1 <= min_pixels <= max_pixels):  # HF takes inf
        raise ValueError(f"min_pixels={min_pixels!r}, max_pixels={max_pixels!r}: need 1 <= min_pixels <= max_pixels")


def check_geometry(patch_size: int, merge_size: int, temporal_patch_size: int) -> None:
    """Refuse a patch geometry that is not three positive integers, before any input is read."""
    for setting, value in [
        ("patch_size", patch_size),
        ("merge_size", merge_size),
        ("temporal_patch_size", temporal_patch_size),
    ]:
        if not is_int(value) or value < 1:
            raise ValueError(f"{setting} must be a positive integer, got {value!r}")


def resized_size(
    image: Image.Image, min_pixels: int, max_pixels: int, factor: int = 32, name: str = ""
) -> tuple[int, int]:
    """(height, width) `preprocess_image` resizes `image` to; an aspect-ratio error names the input."""
    try:
        return smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
    except ValueError as e:
        raise ImageInputError(name or input_name(image), str(e)) from e


def video_frame_pixels(num_frames: int, min_pixels: int, max_pixels: int, factor: int = 32) -> int:
    """HF's per-frame pixel budget for a `num_frames`-frame video (`cap_pixels_per_frame`): `MAX_VIDEO_TOKENS`
    tokens or an even share of `max_pixels`, whichever is smaller, but at least 1.05 x `min_pixels`."""
    return max(min(MAX_VIDEO_TOKENS * factor * factor, max_pixels // num_frames), int(min_pixels * 1.05))


def video_resized_size(
    num_frames: int,
    height: int,
    width: int,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    cap_pixels_per_frame: bool = True,
    factor: int = 32,
    temporal_factor: int = 2,
) -> tuple[int, int]:
    """(height, width) every frame of a `num_frames`-frame video is resized to: HF's `Qwen3VLVideoProcessor.resize`.

    With `cap_pixels_per_frame` the budget is first limited to `video_frame_pixels` per frame. Then
    HF's video `smart_resize`: sides shorter than `factor` are scaled up (truncating), the aspect ratio must
    stay within 200, sides round (half to even) to multiples of `factor`, and the area times the frame
    count is brought into [min_pixels, max_pixels]. Raises ValueError for fewer than `temporal_factor`
    frames or too extreme an aspect ratio, as HF does.
    """
    if cap_pixels_per_frame:
        max_pixels = video_frame_pixels(num_frames, min_pixels, max_pixels, factor) * num_frames
    if num_frames < temporal_factor:
        raise ValueError(
            f"a video needs at least {temporal_factor} frames (one temporal patch), got {num_frames}; "
            "encode a single frame as an image"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    return _fit(height, width, factor, min_pixels, max_pixels, frames=num_frames, t_bar=t_bar)


def video_size(
    clip: Clip,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    cap_pixels_per_frame: bool = True,
    *,
    factor: int = 32,
    temporal_factor: int = 2,
    name: str = "<video>",
) -> tuple[int, int]:
    """`video_resized_size` for a clip; its errors are `VideoInputError`s naming the input."""
    try:
        return video_resized_size(
            clip.count, clip.height, clip.width, min_pixels, max_pixels, cap_pixels_per_frame, factor, temporal_factor
        )
    except ValueError as e:
        raise VideoInputError(name, str(e)) from e


def video_rows(
    clip: Clip, height: int, width: int, out: np.ndarray, *, patch_size: int, merge_size: int, temporal_patch_size: int
) -> None:
    """Write the clip's pixel rows into `out` (float32, bfloat16 or `LEVELS`, `[t*h*w, 3*T*P*P]`), a temporal group
    at a time.

    Each group's frames are resized (`vitjax.resize`), patchified in HF's order and let go as soon as they are
    decoded; groups are resized by `RESIZE_THREADS` threads (numpy releases the GIL) while decoding goes on, with
    at most two groups per thread waiting, so memory stays a few frames whatever the clip's length.
    """
    m, p, tp = merge_size, patch_size, temporal_patch_size
    grid_h, grid_w = height // p, width // p
    group_rows = grid_h * grid_w

    def write(frames: list[np.ndarray], rows: np.ndarray) -> None:
        resized = resize_bicubic(np.stack(frames + frames[-1:] * (tp - len(frames))), height, width)  # HF repeats
        # (tp, bh, mh, ph, bw, mw, pw, C) -> (bh, bw, mh, mw, C, tp, ph, pw): HF's patchify order within a group
        windows = resized.reshape(tp, grid_h // m, m, p, grid_w // m, m, p, 3).transpose(1, 4, 2, 5, 7, 0, 3, 6)
        if rows.dtype == LEVELS:
            rows.reshape(windows.shape)[...] = windows
        else:
            table = _ROW_TABLES["torchvision"][rows.dtype]
            np.take(table, np.ascontiguousarray(windows).reshape(rows.shape), out=rows, mode="clip")

    with ThreadPoolExecutor(RESIZE_THREADS, "vitjax-video") as pool:
        pending: deque[Future] = deque()
        group: list[np.ndarray] = []
        start = 0

        def submit() -> None:
            nonlocal group, start
            pending.append(pool.submit(write, group, out[start : start + group_rows]))
            group, start = [], start + group_rows

        for frame in clip.frames():
            group.append(frame)
            if len(group) == tp:
                submit()
                while len(pending) > 2 * RESIZE_THREADS:
                    pending.popleft().result()
        if group:
            submit()
        for future in pending:
            future.result()


def preprocess_video(
    video: object,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    video_fps: float | None = None,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    cap_pixels_per_frame: bool = True,
    min_frames: int = MIN_FRAMES,
    max_frames: int = MAX_FRAMES,
    patch_size: int = 16,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    name: str | None = None,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One video -> (pixel_values [t*h*w, 3*T*P*P] float32, grid_thw [1, 3]), as HF's `Qwen3VLVideoProcessor`.

    `video` is a `Video`, a path to a video file, a uint8 array `[T, H, W, 3]` or a list of frames. A file
    is sampled at `fps` (default 2) or to `num_frames`; an array or list is used frame by frame unless
    `fps` or `num_frames` is given (`video_fps`: its frame rate, default 24 as HF assumes). A `Video`
    carries these settings itself. Rows are patches, temporal groups outermost and merge windows inside;
    columns (channel, frame of the pair, row, col). Errors are `VideoInputError`s naming the input. `out`
    as for `preprocess_image`.
    """
    check_pixel_bounds(min_pixels, max_pixels)
    check_geometry(patch_size, merge_size, temporal_patch_size)
    check_frame_bounds(min_frames, max_frames)
    if not isinstance(video, Video):
        video = Video(video, fps=fps, num_frames=num_frames, video_fps=video_fps)
    elif (fps, num_frames, video_fps) != (None, None, None):
        raise ValueError("preprocess_video: give sampling settings either in the Video or as arguments, not both")
    name = name if name is not None else (os.fspath(video.source) if video.is_file else "<video>")
    clip = open_clip(video, name, min_frames, max_frames)
    factors = {"factor": patch_size * merge_size, "temporal_factor": temporal_patch_size}
    height, width = video_size(clip, min_pixels, max_pixels, cap_pixels_per_frame, name=name, **factors)
    grid = (-(-clip.count // temporal_patch_size), height // patch_size, width // patch_size)
    out = _output(out, (grid[0] * grid[1] * grid[2], 3 * temporal_patch_size * patch_size * patch_size))
    geometry = {"patch_size": patch_size, "merge_size": merge_size, "temporal_patch_size": temporal_patch_size}
    video_rows(clip, height, width, out, **geometry)
    return out, np.array([grid], dtype=np.int64)
