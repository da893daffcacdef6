"""Static-shape buckets: which bucket shapes exist, and how a request is cut into calls of them.

XLA compiles one program per input shape. Every tower call is padded to one of a small set of bucket
shapes (tokens, frame segments), so a process compiles each bucket once (`vitjax.engine` keeps the executables).
Padding tokens sit after the last image, belong to no segment (id -1) and are neither attended nor
attending; unused segment slots start at T with length 0. A size the ladder fits loosely gets a tighter
bucket once it repeats (`BucketPolicy.fitted`). Host-side geometry only: nothing here touches a device.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from vitjax import layout
from vitjax.checks import is_int

# Token sizes: steps of 512 up to 4096, then ~1.25x (multiples of 1024). Padded rows cost GEMM time only
# (attention skips them): at most ~25% of it, ~12% on average.
DEFAULT_TOKENS = tuple(512 * k for k in range(1, 9)) + tuple(
    1024 * k for k in (5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)
)
# Segment slots: images, or a video's temporal slices (one a second at HF's defaults). Up to 384 = the slices of
# `vitjax.video.MAX_FRAMES` frames, so no default-sampled clip needs an executable of its own: a dedicated
# segment count costs a compile (~1 s) on the first clip of each length; unused slots cost fa4 and cuDNN a
# little (a clip of 65 to 257 slices in a bucket of 128 to 384: <= +0.7% of the call, bench/NOTES.md).
DEFAULT_SEGMENTS = (1, 4, 16, 64, 128, 256, 384)
# Frames hold at least this many patches at Qwen3-VL's default min_pixels; the warm-up set assumes it.
MIN_FRAME_TOKENS = 256
# A call size seen again (`vitjax.engine.FIT_AFTER`) moves, once it is compiled, to a bucket of its tokens rounded up
# to this (a multiple of `vitjax.engine.MAX_CHUNK_ROWS`): padded rows cost the GEMMs and the passes around them; on an
# H100 repeated requests of 4-32 720p images ran 6-8% faster, of 2-8 2K images 1-4%, the 20 photos (96,256 tokens,
# not 98,304) 0-3% (NOTES).
FIT_GRANULE = 2048
# A call on cuDNN's padded path holds at most this many times its bucket's tokens in its padded batch (slots x the
# longest frame's length), or twice the largest ladder bucket. Calls of equal frames, images or a video's, stay within
# it on the default ladders (checked for every frame size and count); only a mix of long and short frames is cut.
PADDED_EXCESS = 8


class Bucket(NamedTuple):
    """One compiled shape: `tokens` rows, up to `segments` frames (images, or temporal groups of a video)."""

    tokens: int
    segments: int


def checked_bucket(value: object) -> Bucket:
    """A bucket a caller names, `(tokens, segments)`: positive integers, tokens in whole 2x2 merge groups (a multiple
    of 4); else a ValueError naming it, before anything is compiled."""
    try:
        tokens, segments = value
    except (TypeError, ValueError):
        raise ValueError(f"a bucket is (tokens, segments), got {value!r}") from None
    if not (is_int(tokens) and is_int(segments) and tokens > 0 and segments > 0 and tokens % 4 == 0):
        raise ValueError(f"bucket {value!r}: tokens and segments must be positive integers, tokens a multiple of 4")
    return Bucket(int(tokens), int(segments))


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """Which bucket shapes exist, and how a request is cut into calls.

    `tokens` and `segments` are ascending ladders; a call gets the smallest bucket holding it. An image
    larger than the largest bucket gets a dedicated one, its tokens rounded up to `granule`. A call whose size
    repeats moves to a bucket of its tokens rounded up to `fit_granule` (0: never), see `fitted`.
    """

    tokens: tuple[int, ...] = DEFAULT_TOKENS
    segments: tuple[int, ...] = DEFAULT_SEGMENTS
    granule: int = 1024
    fit_granule: int = FIT_GRANULE

    def __post_init__(self) -> None:
        for name in ("tokens", "segments"):
            ladder = tuple(int(v) for v in getattr(self, name))
            if not ladder or list(ladder) != sorted(set(ladder)) or ladder[0] < 1:
                raise ValueError(f"bucket {name} must be ascending positive integers, got {ladder}")
            object.__setattr__(self, name, ladder)
        if self.granule < 4:
            raise ValueError(f"bucket granule must be a positive multiple of 4, got {self.granule}")
        bad = [t for t in (*self.tokens, self.granule) if t % 4]
        if bad:
            raise ValueError(f"bucket token sizes must be multiples of 4 (2x2 merge groups), got {bad}")
        if self.fit_granule < 0 or self.fit_granule % 4:
            raise ValueError(f"fit_granule must be 0 (off) or a multiple of 4, got {self.fit_granule}")

    def check_group(self, devices: int) -> None:
        """Refuse sizes that do not split over a sequence-parallel group of `devices` in whole 2x2 merge groups
        (else a call would fail once it is sized)."""
        if any(t % (4 * devices) for t in (*self.tokens, self.granule, self.fit_granule)):
            raise ValueError(
                f"bucket tokens {self.tokens}, granule {self.granule} and fit_granule {self.fit_granule} must be "
                f"multiples of {4 * devices} to split in whole 2x2 merge groups over a sequence-parallel group of "
                f"{devices} devices"
            )

    def fit(self, tokens: int, segments: int) -> Bucket:
        """The smallest bucket holding a call; a dedicated one past the ladders."""
        i = bisect.bisect_left(self.tokens, tokens)
        t = self.tokens[i] if i < len(self.tokens) else -(-tokens // self.granule) * self.granule
        j = bisect.bisect_left(self.segments, segments)
        return Bucket(t, self.segments[j] if j < len(self.segments) else segments)

    def fitted(self, bucket: Bucket, tokens: int) -> Bucket | None:
        """A tighter bucket for a call of `tokens` that `bucket` holds: its tokens rounded up to `fit_granule`,
        the same slots; None where that saves nothing."""
        t = -(-tokens // self.fit_granule) * self.fit_granule if self.fit_granule else bucket.tokens
        return Bucket(t, bucket.segments) if t < bucket.tokens else None

    def plan(self, grids: Sequence[layout.Grid], padded: bool = False) -> list[tuple[Bucket, list[int]]]:
        """Cut a request into calls of whole images, in input order, each as full as the largest bucket allows.

        With `padded` (cuDNN over a padded batch, `attention.padded_batch`) a call also ends before an image that
        would make its batch (`padded_rows`) more than `PADDED_EXCESS` times its bucket's tokens and twice the largest
        ladder bucket's: every slot is as long as the longest frame, so one large photo among many small ones would
        ask for tens of GiB.
        """
        calls: list[list[int]] = []
        tokens = segments = longest = 0
        for i, grid in enumerate(grids):
            n, s, frame = layout.grid_tokens(grid), grid[0], grid[1] * grid[2]
            fits = bool(calls) and tokens + n <= self.tokens[-1] and segments + s <= self.segments[-1]
            if fits and padded:
                bucket = self.fit(tokens + n, segments + s)
                limit = max(PADDED_EXCESS * bucket.tokens, 2 * self.tokens[-1])
                fits = self.padded_rows(bucket, max(longest, frame)) <= limit
            if fits:
                calls[-1].append(i)
                tokens, segments, longest = tokens + n, segments + s, max(longest, frame)
            else:
                calls.append([i])
                tokens, segments, longest = n, s, frame
        return [(self.fit(sum(layout.grid_tokens(grids[i]) for i in c), sum(grids[i][0] for i in c)), c) for c in calls]

    def padded_rows(self, bucket: Bucket, longest_frame: int) -> int:
        """The rows of a call's padded batch: its bucket's slots, each of the ladder size holding its longest frame."""
        return bucket.segments * self.padded_length(bucket, longest_frame)

    def padded_length(self, bucket: Bucket, longest_frame: int) -> int:
        """A padded batch's slot length (static, compiled per bucket and length): the smallest ladder size holding the
        call's longest frame."""
        return min(bucket.tokens, self.fit(longest_frame, 1).tokens)

    def buckets(self) -> list[Bucket]:
        """The default warm-up set: the first slot rung at every token size, and every other pair of the ladders that a
        call of frames of at least `MIN_FRAME_TOKENS` patches can land in. A call takes the smallest slot rung holding
        its frames, so a rung holds calls of one more frame than the rung below it upwards (two 256-patch images: 512
        tokens in 4 slots)."""
        fewest = dict(zip(self.segments[1:], (s + 1 for s in self.segments), strict=False))  # frames that need a rung
        return [Bucket(t, s) for t in self.tokens for s in self.segments if fewest.get(s, 0) * MIN_FRAME_TOKENS <= t]
