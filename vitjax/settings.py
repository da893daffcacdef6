"""The settings of `Encoder.encode` (and `vitjax encode`), checked before any model is built or image decoded.

A bad setting is a `SettingError` that names the setting, the value and what is accepted, raised before any
work is spent: settings are not per-input problems, so `errors="return"` does not turn them into results.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from tqdm import tqdm

from vitjax.checks import is_int, is_positive
from vitjax.config import VisionConfig
from vitjax.pipeline import DECODERS
from vitjax.preprocess import (
    BACKEND_CHOICES,
    IMAGE_PROCESSOR_BACKENDS,
    MAX_PIXELS,
    MIN_PIXELS,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    video_frame_pixels,
)
from vitjax.video import MAX_FRAMES

# Patches per tower call when encoding images (an image or video of more is a call of its own). With today's tower
# calls of ~13 photos beat calls of ~5 (20 x 960x1280 JPEGs on an H100: 404-451 ms vs 436-456, bench/NOTES.md): the
# device's share shrank, and fewer calls pad fewer rows and launch less.
BATCH_TOKENS = 65536
# The most pixels `max_pixels` may allow per image unless raised deliberately (`pixel_limit`): Qwen3-VL's own
# longest_edge. Host memory per image in flight and the device memory of its call grow with it.
PIXEL_LIMIT = MAX_PIXELS
ERRORS = ("raise", "return")
# The most preprocessing threads a request may ask for: each may hold up to four decoded inputs (the pipeline's window
# is twice its threads, and twice the window may be decoded at once), and past 16 they gained nothing on a 64-core
# host (bench/NOTES.md).
MAX_WORKERS = 64


class SettingError(ValueError):
    """A setting outside its accepted range; `setting` is its keyword name (the CLI shows it as an option)."""

    def __init__(self, setting: str, value: object, accepted: str):
        super().__init__(f"{setting}={value!r}: {accepted}")
        self.setting = setting
        self.value = value
        self.accepted = accepted


@dataclass(frozen=True)
class EncodeSettings:
    """Per-request settings. `batch_tokens` (None: `BATCH_TOKENS`) is the patches per tower call; an image or video of
    more patches is encoded in a call of its own.
    `video_min_pixels` / `video_max_pixels` bound a video's pixels (HF's video `size`); `fps` or `num_frames`
    sample video files given as paths (default: 2 frames per second). `image_processor_backend` names the HF image
    processor whose rows images get: "pil" (`Qwen2VLImageProcessorPil`) or "torchvision" (`Qwen2VLImageProcessor`,
    which `AutoProcessor` builds by default). `workers` is the number of threads that decode and preprocess (None:
    one a core, up to 16: `pipeline.default_workers`)."""

    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    pixel_limit: int = PIXEL_LIMIT
    batch_tokens: int | None = None
    errors: str = "raise"
    progress: bool | tqdm = False
    decoder: str = "auto"
    video_min_pixels: int = VIDEO_MIN_PIXELS
    video_max_pixels: int = VIDEO_MAX_PIXELS
    fps: float | None = None
    num_frames: int | None = None
    image_processor_backend: str = "pil"
    workers: int | None = None

    def checked(self, cfg: VisionConfig) -> EncodeSettings:
        """These settings validated against the tower's patch geometry, with `batch_tokens` resolved."""
        window = (cfg.patch_size * cfg.spatial_merge_size) ** 2  # the smallest image: one merge window
        for name in ("min_pixels", "max_pixels", "pixel_limit", "batch_tokens", "video_min_pixels", "video_max_pixels"):
            value = getattr(self, name)
            if not (value is None and name == "batch_tokens") and not is_int(value):
                raise SettingError(name, value, "must be an integer")
        if self.pixel_limit < window:
            raise SettingError("pixel_limit", self.pixel_limit, f"must be at least {window} (one merge window)")
        if not window <= self.max_pixels <= self.pixel_limit:
            raise SettingError(
                "max_pixels",
                self.max_pixels,
                f"must be from {window} (one {cfg.patch_size * cfg.spatial_merge_size}-pixel merge window) to "
                f"pixel_limit={self.pixel_limit}; raise pixel_limit deliberately to allow larger images",
            )
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise SettingError("min_pixels", self.min_pixels, f"must be from 1 to max_pixels={self.max_pixels}")
        if not window <= self.video_max_pixels <= self.pixel_limit:
            raise SettingError(
                "video_max_pixels", self.video_max_pixels, f"must be from {window} to pixel_limit={self.pixel_limit}"
            )
        if not 1 <= self.video_min_pixels <= self.video_max_pixels:
            raise SettingError(
                "video_min_pixels",
                self.video_min_pixels,
                f"must be from 1 to video_max_pixels={self.video_max_pixels}",
            )
        if self.fps is not None and not is_positive(self.fps):
            raise SettingError("fps", self.fps, "must be a positive number of frames per second")
        frames = cfg.temporal_patch_size  # fewer make no video: HF refuses them too
        if self.num_frames is not None and not (is_int(self.num_frames) and frames <= self.num_frames <= MAX_FRAMES):
            accepted = f"must be an integer from {frames} (one temporal patch) to {MAX_FRAMES} (HF's max_frames)"
            raise SettingError("num_frames", self.num_frames, accepted)
        if self.fps is not None and self.num_frames is not None:
            raise SettingError("num_frames", self.num_frames, f"excludes fps={self.fps}; give one of them")
        if self.workers is not None and not (is_int(self.workers) and 1 <= self.workers <= MAX_WORKERS):
            raise SettingError("workers", self.workers, f"must be an integer from 1 to {MAX_WORKERS} (threads)")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise SettingError("batch_tokens", self.batch_tokens, "must be at least 1 (patches per call)")
        if self.errors not in ERRORS:
            raise SettingError("errors", self.errors, f"must be one of {', '.join(map(repr, ERRORS))}")
        if self.decoder not in DECODERS:
            raise SettingError("decoder", self.decoder, f"must be one of {', '.join(map(repr, DECODERS))}")
        if self.image_processor_backend not in IMAGE_PROCESSOR_BACKENDS:
            raise SettingError("image_processor_backend", self.image_processor_backend, BACKEND_CHOICES)
        if not isinstance(self.progress, (bool, tqdm)):
            raise SettingError("progress", self.progress, "must be True, False or a tqdm bar")
        batch_tokens = BATCH_TOKENS if self.batch_tokens is None else self.batch_tokens
        largest = self.largest_patches(cfg)  # the largest image: a call of its own
        call = max(batch_tokens, largest)
        rows, memory = call * cfg.patch_dim * 2, _host_memory()  # a call's pixel rows, bfloat16 at least
        if rows > memory:
            setting = "batch_tokens" if batch_tokens > largest else "max_pixels"
            raise SettingError(
                setting,
                getattr(self, setting),
                f"a call of {call} patches needs {rows / 2**30:.1f} GiB of pixel rows, more than this "
                f"machine's {memory / 2**30:.1f} GiB of memory",
            )
        clip = self.largest_patches(cfg, videos=True) * cfg.patch_dim * 2  # a `Video` may sample MAX_FRAMES
        if clip > memory:  # only a raised video_min_pixels gets here: video_max_pixels is held to pixel_limit
            raise SettingError(
                "video_min_pixels",
                self.video_min_pixels,
                f"a clip of {MAX_FRAMES} frames gets a budget of {int(self.video_min_pixels * 1.05)} pixels a frame: "
                f"{clip / 2**30:.1f} GiB of pixel rows, more than this machine's {memory / 2**30:.1f} GiB of memory",
            )
        return replace(self, batch_tokens=batch_tokens)

    def largest_patches(self, cfg: VisionConfig, videos: bool = False, frames: int = MAX_FRAMES) -> int:
        """About the patches of the largest image `max_pixels` allows or, with `videos`, of the largest input these
        settings allow with clips of at most `frames` frames: a clip's frames share video_max_pixels, but each keeps
        at least 1.05 x video_min_pixels (HF's per-frame floor), so a raised video_min_pixels makes a long clip far
        larger than video_max_pixels says. Sides rounded to the 32-pixel grid can add more (at extreme aspect ratios,
        or with min_pixels near max_pixels, up to ~1.4x)."""
        image = self.max_pixels // cfg.patch_size**2
        if not videos:
            return image
        factor = cfg.patch_size * cfg.spatial_merge_size
        per_frame = video_frame_pixels(frames, self.video_min_pixels, self.video_max_pixels, factor)
        groups = -(-frames // cfg.temporal_patch_size)  # an odd frame count's last group is padded
        return max(image, groups * per_frame // cfg.patch_size**2)


def _host_memory() -> float:
    """The machine's physical memory in bytes (unbounded where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return math.inf
