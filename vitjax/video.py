"""Videos as inputs: the `Video` wrapper, HF's frame sampling, and decoding video files with PyAV.

Frame sampling is HF transformers' `Qwen3VLVideoProcessor.sample_frames` (default 2 frames per second of
the source, at least 4 and at most 768 frames, never more than the video has; or exactly `num_frames`,
evenly spaced, which vitjax also holds to at most 768). Files are read with PyAV as HF's processor given a path
reads them, which is torchcodec in `seek_mode="exact"` (`transformers.video_utils.read_video_torchcodec`; SGLang
reads videos with torchcodec too): the best video stream; its frames are its packets, less those an edit list cuts,
in presentation order; the rate is their count over their span of time (the stream's r_frame_rate if that is
zero); a frame sampled twice comes twice; a frame past the next keyframe is reached by seeking to its own keyframe
(the frames in between are not decoded); frames are converted with `to_ndarray(format="rgb24")` (swscale's
bicubic, as torchcodec converts) and turned upright by the stream's display matrix (a phone's portrait video). On
MP4, MKV, MOV, FLV and WebM (what the tests hold it to) the frames are the ones HF and SGLang get. Where torchcodec
mistimes frames (B-frames in AVI, MPEG-PS, MPEG-TS or a bare MPEG-2 stream on FFmpeg 5.1, seen) vitjax takes the
frames in presentation order and HF others; where the frames' own times come out shuffled (H.264 with B-frames in
AVI), frame i is the i-th decoded (`_shuffled_times`).
PyAV is an optional dependency (`pip install 'vitjax[video]'`), imported only when a file is decoded.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vitjax.checks import is_int, is_positive
from vitjax.images import (
    VIDEO_EXTENSIONS,
    ImageInputError,
    as_path,
    check_pixels,
    is_data_uri,
    load_image,
    missing_reason,
)

# Qwen3VLVideoProcessor's defaults: frames sampled per second, and the bounds on the number sampled.
FPS, MIN_FRAMES, MAX_FRAMES = 2.0, 4, 768
# A raw stream without a container (an .h264 or .hevc file) times none of its frames: torchcodec, which HF and SGLang
# read files with, cannot read one either.
UNTIMED = (
    "its frames have no timestamps (a raw video stream without a container?); put it in one at its frame rate "
    "first, e.g. ffmpeg -framerate 30 -i IN -c copy OUT.mp4"
)
# The frame rate HF assumes when asked to sample by fps without knowing the video's own.
DEFAULT_VIDEO_FPS = 24.0
# Frames decoded at the start of a file to tell whether their times were shuffled by reordering (`_shuffled_times`):
# H.264 reorders at most 16.
REORDER_WINDOW = 32


class VideoInputError(ImageInputError):
    """A video input that cannot be turned into frames (or into pixel rows); `name` says which, `reason` why."""


@dataclass(frozen=True, eq=False)
class Video:
    """An explicit video input: a file path, a uint8 array `[T, H, W, 3]`, or a sequence of frames (anything
    `load_image` takes, all of one size).

    A file is always sampled (`fps`, default 2, or `num_frames`). An array or frame list is used as it is,
    every frame, unless `fps` or `num_frames` asks for sampling; `video_fps` is then its frame rate
    (HF assumes 24 when it is not given). `fps` and `num_frames` exclude each other, as in HF.
    """

    source: str | os.PathLike | np.ndarray | Sequence[object]
    fps: float | None = None
    num_frames: int | None = None
    video_fps: float | None = None

    def __post_init__(self):
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("Video: fps and num_frames exclude each other; give one")
        for field, value in (("fps", self.fps), ("num_frames", self.num_frames), ("video_fps", self.video_fps)):
            if value is not None and not is_positive(value):
                raise ValueError(f"Video: {field} must be a positive finite number, got {value!r}")
        if self.num_frames is not None and not is_int(self.num_frames):
            raise ValueError(f"Video: num_frames must be a whole number, got {self.num_frames!r}")
        if self.video_fps is not None and self.is_file:
            raise ValueError("Video: video_fps is for arrays and frame lists; a file's frame rate is read from it")

    @property
    def is_file(self) -> bool:
        return isinstance(self.source, (str, os.PathLike))

    @property
    def settings(self) -> tuple:
        """What the sampled frames depend on besides the source: part of the embedding cache's key. The source's kind
        too: a file's digest is its sha256, which no array's (of a prefix and the frames) may share a key with."""
        fps = FPS if self.is_file and self.fps is None and self.num_frames is None else self.fps
        return ("video", "file" if self.is_file else "frames", fps, self.num_frames, self.video_fps)


def is_video_path(source: object) -> bool:
    """A path (not a data URI) whose extension names a video container."""
    source = as_path(source)
    is_path = isinstance(source, (str, Path)) and not is_data_uri(source)
    return is_path and Path(source).suffix.lower() in VIDEO_EXTENSIONS


def video_name(video: Video, index: int = 0) -> str:
    """How errors name a video: its path, else its kind and position among the inputs."""
    return os.fspath(video.source) if video.is_file else f"<video #{index}>"


def check_frame_bounds(min_frames: int, max_frames: int) -> None:
    """Refuse sampling bounds that are not whole numbers with 1 <= min_frames <= max_frames, before any input is
    read (HF divides by zero, or indexes an empty sample)."""
    if not (is_int(min_frames) and is_int(max_frames) and 1 <= min_frames <= max_frames):
        raise ValueError(
            f"min_frames={min_frames!r}, max_frames={max_frames!r}: need integers with 1 <= min_frames <= max_frames"
        )


def sample_indices(
    total: int,
    video_fps: float | None,
    fps: float | None = None,
    num_frames: int | None = None,
    min_frames: int = MIN_FRAMES,
    max_frames: int = MAX_FRAMES,
) -> np.ndarray:
    """HF's `Qwen3VLVideoProcessor.sample_frames`: frame indices of a `total`-frame video at `video_fps`.

    With `num_frames` exactly that many, evenly spaced (repeating frames if the video has fewer), at most
    `max_frames` (a bound HF leaves out); else `fps` per second of video (default 2), clamped to
    [min_frames, max_frames] and to `total`.
    """
    if fps is not None and num_frames is not None:
        raise ValueError("fps and num_frames exclude each other; give one")
    if num_frames is not None and num_frames > max_frames:  # HF takes any: 10**9 would fill memory before failing
        raise ValueError(f"num_frames={num_frames}: at most max_frames={max_frames} frames are sampled")
    if num_frames is None:
        rate = video_fps if video_fps is not None else DEFAULT_VIDEO_FPS
        wanted = total / rate * (fps if fps is not None else FPS)  # may overflow to inf: clamped before int()
        num_frames = min(max(int(min(wanted, max_frames)), min_frames), max_frames, total)
    return np.linspace(0, total - 1, int(num_frames)).round().astype(int)


@dataclass(frozen=True)
class Clip:
    """A video's sampled frames, known by number and size before any is decoded (so that a planner can size its
    rows first and the frames can be resized as they are decoded, never all held at full size)."""

    count: int
    height: int
    width: int
    frames: Callable[[], Iterator[np.ndarray]]  # the sampled frames in order, uint8 [H, W, 3] each
    digest: Callable[[], str]  # sha256 of the file's bytes, or of the sampled frames of an array or list


def open_clip(
    video: Video, name: str | None = None, min_frames: int = MIN_FRAMES, max_frames: int = MAX_FRAMES
) -> Clip:
    """The frames `video` stands for, sampled as HF samples them. A file is probed here (frame count, rate and
    size from its video stream, as torchcodec takes them for HF's processor) and decoded only when `frames()` is
    iterated.

    Every failure (missing or undecodable file, no video stream, a bad array, frames of different sizes, no
    PyAV; while decoding: fewer frames than the container promised) is a `VideoInputError` naming the input.
    """
    name = name if name is not None else video_name(video)
    source = video.source
    sampled = video.is_file or video.fps is not None or video.num_frames is not None
    try:
        if video.is_file:
            return _probe_file(Path(source), name, video, min_frames, max_frames)
        if isinstance(source, np.ndarray):
            if source.dtype != np.uint8 or source.ndim != 4 or source.shape[3] != 3 or 0 in source.shape:
                raise ValueError(f"video array must be uint8 [T, H, W, 3], got {source.dtype} {list(source.shape)}")
            indices = _indices(video, len(source), min_frames, max_frames) if sampled else range(len(source))
            frames = source
        elif isinstance(source, (str, bytes, bytearray, memoryview)) or not isinstance(source, Sequence):
            raise ValueError(f"unsupported video source {type(source).__name__}: a path, an array or a frame list")
        elif not source:
            raise ValueError("video has no frames")
        else:
            indices = _indices(video, len(source), min_frames, max_frames) if sampled else range(len(source))
            # Every frame is read, as HF stacks them all before sampling: one of another size, or that cannot be
            # decoded, fails the video whether or not it is sampled. Each sampled frame is kept once, however often
            # it repeats.
            kept, frames, sizes = set(indices), {}, set()
            for i, item in enumerate(source):
                frame = np.asarray(load_image(item, f"{name} frame {i}"))
                sizes.add(frame.shape)
                if i in kept:
                    frames[i] = frame
            if len(sizes) > 1:
                shown = ", ".join(f"{w}x{h}" for h, w, _ in sorted(sizes))
                raise ValueError(f"frames differ in size ({shown}); a video's frames must share one size")
    except VideoInputError:
        raise
    except ImageInputError as e:  # one frame of a frame list
        raise VideoInputError(name, str(e)) from e
    except ValueError as e:
        raise VideoInputError(name, str(e)) from e
    height, width = frames[indices[0]].shape[:2]

    def sampled_frames() -> Iterator[np.ndarray]:  # views: a short clip sampled to many frames is not copied
        return (frames[i] for i in indices)

    def digest() -> str:
        h = hashlib.sha256(f"frames:{len(indices)}x{height}x{width}x3:".encode())
        for frame in sampled_frames():
            h.update(np.ascontiguousarray(frame).data)
        return h.hexdigest()

    return Clip(len(indices), height, width, sampled_frames, digest)


def _indices(video: Video, total: int, min_frames: int, max_frames: int, rate: float | None = None) -> np.ndarray:
    fps = video.fps if video.fps is not None or video.num_frames is not None else FPS
    return sample_indices(total, rate or video.video_fps, fps, video.num_frames, min_frames, max_frames)


def _av(name: str):
    try:
        import av
    except ImportError as e:
        raise VideoInputError(name, "decoding video files needs PyAV: pip install 'vitjax[video]'") from e
    return av


def _probe_file(path: Path, name: str, video: Video, min_frames: int, max_frames: int) -> Clip:
    av = _av(name)
    reason = missing_reason(path)
    if reason is not None:
        raise VideoInputError(name, reason)
    if path.is_dir():
        raise VideoInputError(name, "is a directory")
    if not path.is_file():
        raise VideoInputError(name, "not a regular file")
    try:
        with av.open(os.fspath(path)) as container:
            stream = container.streams.best("video")
            if stream is None:
                raise VideoInputError(name, "no video stream")
            if stream.codec_context is None:
                raise VideoInputError(name, "no decoder for its video codec")
            check_pixels(stream.width, stream.height, "video frame")
            # torchcodec's scan: a frame per packet (not the empty ones PyAV adds at the end, not those an edit
            # list cuts), timed by its pts (else dts); the rate is their count over the time they span.
            packets = [
                (packet.pts if packet.pts is not None else packet.dts, packet.duration, packet.is_keyframe)
                for packet in container.demux(stream)
                if packet.size and not packet.is_discard
            ]
            # read while the file is open: the stream's fields live in FFmpeg's memory, freed when it closes
            unit, base_rate = stream.time_base.numerator / stream.time_base.denominator, stream.base_rate
            size = (stream.height, stream.width)
        timed = [(pts, duration, key) for pts, duration, key in packets if pts is not None]
        if packets and not timed:
            raise VideoInputError(name, UNTIMED)
        times = [pts for pts, _, _ in timed]
        source = _FileFrames(av, path, frame_threads=False)
        try:
            decoded = source.from_start()
            first = next(decoded, None) if times else None
            if first is None:
                raise VideoInputError(name, "video stream has no frames")
            by_count = _shuffled_times(source.stream, times, first, decoded)
            turns = _quarter_turns(_rotation(first))
        finally:
            source.close()
    except VideoInputError:
        raise
    except (av.FFmpegError, OSError) as e:
        raise VideoInputError(name, f"cannot decode video ({getattr(e, 'strerror', None) or e})") from e
    except ValueError as e:  # check_pixels, a rotation that is no quarter turn
        raise VideoInputError(name, str(e)) from e
    span = max(pts + duration for pts, duration, _ in timed) * unit - min(times) * unit
    rate = len(times) / span if span else float(base_rate) if base_rate else None
    try:
        wanted = _indices(video, len(times), min_frames, max_frames, rate).tolist()
    except ValueError as e:
        raise VideoInputError(name, str(e)) from e
    starts = sorted(times)  # frame i is the first decoded at or after starts[i]
    keys = sorted(pts for pts, _, key in timed if key)

    def frames() -> Iterator[np.ndarray]:
        yield from _decode(av, path, name, wanted, None if by_count else (starts, keys), len(starts), size, turns)

    def digest() -> str:
        h = hashlib.sha256()  # the file's own sha256, as `sha256sum` gives it (and DALI's items)
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()

    return Clip(len(wanted), *(size[::-1] if turns % 2 else size), frames, digest)


def _shuffled_times(stream, packet_times: list[int], first, decoded: Iterator) -> bool:
    """Whether the frames' times mean nothing, so that frame i is the i-th decoded. A decoder gives its frames in
    presentation order; a codec that reorders frames (B-frames) has its packets' times out of order. Where they are
    in order anyway (H.264 with B-frames in AVI, whose times FFmpeg guesses from the decode order) the frames come out
    with shuffled times, and picking by time took wrong frames (torchcodec takes wrong ones too). Seen in the first
    `REORDER_WINDOW` frames decoded."""
    if not stream.codec_context.has_b_frames or any(b <= a for a, b in itertools.pairwise(packet_times)):
        return False
    seen = [_time(f) for f in [first, *itertools.islice(decoded, REORDER_WINDOW - 1)]]
    seen = [t for t in seen if t is not None]
    return any(b < a for a, b in itertools.pairwise(seen))


def _time(frame) -> int | None:
    return frame.pts if frame.pts is not None else frame.dts


def _rotation(frame) -> float | None:
    """A decoded frame's display rotation in degrees, as FFmpeg's `av_display_rotation_get` computes it from the
    display matrix (PyAV's `frame.rotation` truncates it to an integer: 45.9997 becomes 45); None without one."""
    matrix = next((bytes(d) for d in frame.side_data if d.type.name == "DISPLAYMATRIX"), None)
    if matrix is None or len(matrix) != 36:
        return None
    a, b, _, c, d = np.frombuffer(matrix, "<i4")[:5].astype(float)  # 16.16 fixed point, row-major 3x3
    x_scale, y_scale = math.hypot(a, c), math.hypot(b, d)
    if not x_scale or not y_scale:
        return None
    return -math.degrees(math.atan2(b / y_scale, a / x_scale))


def _quarter_turns(degrees: float | None) -> int:
    """Counter-clockwise quarter turns that make a frame upright, from its display matrix's rotation (rounded to
    a multiple of 90 degrees, halves away from zero, as torchcodec does: 45 degrees is a quarter turn)."""
    if not degrees:
        return 0
    turns = int(math.copysign(math.floor(abs(degrees) / 90 + 0.5), degrees))
    if not -2 <= turns <= 2:
        raise ValueError(f"rotation of {degrees} degrees is outside [-180, 180]")
    return turns % 4


class _FileFrames:
    """A video file's decoded frames from its start, or from a keyframe. The start is the file opened again: a seek to
    time 0 is not the start where the times are negative or wrap (MPEG-TS's 33-bit clock, in a broadcast recording).
    The first seek that fails or lands past the frame wanted (MPEG-PS, MPEG-TS with B-frames and x264's intra-refresh
    streams seek imprecisely) turns seeking off for the file, whose frames then come from its start."""

    seeks = True

    def __init__(self, av, path: Path, frame_threads: bool = True):
        self._av, self._path, self._threads = av, path, frame_threads
        self._container, self.stream = None, None

    def from_start(self) -> Iterator:
        self.close()
        self._container = self._av.open(os.fspath(self._path))
        self.stream = self._container.streams.best("video")
        if self._threads:
            self.stream.thread_type = "AUTO"  # frame threads: the same frames of an intact stream, on several cores
        return self._container.decode(self.stream)

    def from_keyframe(self, key: int, start: int) -> Iterator:
        """From the keyframe at time `key`, if the seek lands at or before `start`; else from the start."""
        try:
            self._container.seek(key, stream=self.stream)  # backward: to the keyframe at `key`
            decoded = self._container.decode(self.stream)
            first = next(decoded, None)
        except self._av.FFmpegError:
            first = None
        if first is not None and _time(first) is not None and _time(first) <= start:
            return itertools.chain([first], decoded)
        self.seeks = False
        return self.from_start()

    def close(self) -> None:
        if self._container is not None:
            self._container.close()


def _decode(
    av,
    path: Path,
    name: str,
    wanted: list[int],
    timing: tuple[list[int], list[int]] | None,
    count: int,
    size: tuple[int, int],
    turns: int,
) -> Iterator[np.ndarray]:
    """Frames `wanted` (sorted indices, repeats included), turned upright, picked as torchcodec picks them: for the
    index after the last one taken, the next frame decoded; else the first decoded at or after the index's time
    (`timing`: the frames' start times and the keyframes' times). Where that time is behind the last frame taken, or
    its keyframe (the last at or before it) is past the last frame taken, decoding goes to that keyframe, as torchcodec
    seeks there (the frames in between are not decoded). They differ from the i-th decoded frames where a stream
    decodes fewer frames than it has packets (one that starts between keyframes), and where it is damaged (packets
    flagged as keyframes that are none, or frames sharing a time). Without `timing` (times that mean nothing), the
    i-th decoded frames, without seeks."""
    starts, keys = timing if timing is not None else (None, [])
    got, position = 0, 0  # frames taken; frames decoded (read without `timing`, where nothing seeks)
    source = _FileFrames(av, path)
    try:
        decoded, last, last_at = source.from_start(), None, None
        for index, times in sorted(collections.Counter(wanted).items()):
            start = None if starts is None or (last is not None and index == last + 1) else starts[index]
            if start is not None:
                after = bisect.bisect_right(keys, start)
                key = keys[after - 1] if after and source.seeks else None
                if last_at is not None and start <= last_at:
                    decoded = source.from_start() if key is None else source.from_keyframe(key, start)
                elif key is not None and key > (keys[0] if last_at is None else last_at):  # keys[0]: the file's start
                    decoded = source.from_keyframe(key, start)
            for frame in decoded:
                at, position = _time(frame), position + 1
                if starts is None and position - 1 < index:
                    continue
                if start is None or (at is not None and at >= start):
                    break
            else:
                break
            # swscale's bicubic, as torchcodec converts (PyAV's default, bilinear, gives other colours where 4:2:0
            # chroma is not exactly half the frame: odd sides)
            rgb = frame.to_ndarray(format="rgb24", interpolation="BICUBIC")
            if rgb.shape[:2] != size:
                shown = f"{rgb.shape[1]}x{rgb.shape[0]}"
                raise VideoInputError(name, f"frame {index} is {shown}, the stream says {size[1]}x{size[0]}")
            rgb = np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb
            got, last, last_at = got + times, index, at
            for _ in range(times):
                yield rgb
    except (av.FFmpegError, OSError) as e:
        raise VideoInputError(name, f"cannot decode video ({getattr(e, 'strerror', None) or e})") from e
    finally:
        source.close()
    if got < len(wanted):
        raise VideoInputError(name, f"decoded {got} of the {len(wanted)} frames sampled (the file has {count} frames)")
