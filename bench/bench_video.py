"""Video files in, pixel rows out, on the CPU: vitjax `preprocess_video` against HF (PyAV reader + processor, and its
processor given the path, which reads it with torchcodec as SGLang does).

The workload: a clip made from a shipped photograph, panned (H.264, yuv420p, 30 fps), at 1280x720 and 1920x1080,
with x264's default keyframe interval (250 frames) or a keyframe every second (as phones write), sampled at HF's
default 2 frames per second or to 8 frames (processor defaults otherwise, per-frame cap on). HF: its
`load_video(backend="pyav")` (decodes every frame) with the processor's `sample_frames`, then the processor
(torchvision's resize on the CPU); `hf_torchcodec`: the processor given the path (torchcodec seeks to the keyframe
before a sampled frame past the next keyframe). vitjax: `preprocess_video(path)` (decode with PyAV's frame threads,
seeking as torchcodec does; resize each temporal group as it is decoded with `vitjax.resize`: PyTorch's kernel where
installed and exact, as here). `vitjax_sequential` decodes every frame up to the last one sampled (the path before
2026-11-28's seeks); `vitjax_numpy_resize` resizes with the numpy repetition of PyTorch's kernel (the path without
PyTorch). All produce the same rows (checked here, bit for bit); times are medians.

    PYTHONPATH=. python bench/bench_video.py --out bench/results
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
from pathlib import Path
from unittest import mock

import av
import numpy as np
from bench_vit import median_time
from cpu_bench import cpu_meta, numpy_resize, save_rows
from PIL import Image

from vitjax import video
from vitjax.preprocess import preprocess_video

PHOTO = Path(__file__).resolve().parents[1] / "tests" / "data" / "images" / "astronaut.jpg"
SAMPLINGS = {"2 fps": {}, "8 frames": {"num_frames": 8}}


def write_clip(path: Path, height: int, width: int, seconds: float, rate: int = 30, gop: int | None = None) -> Path:
    """A pan over the photo, upscaled so the window can move; frames differ in content as real video does. A keyframe
    every `gop` frames (x264's default, 250, without)."""
    photo = np.asarray(Image.open(PHOTO).convert("RGB").resize((width * 2, height * 2), Image.Resampling.BICUBIC))
    count = int(seconds * rate)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate, options={"g": str(gop)} if gop else {})
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        for i in range(count):
            x, y = i * width // count, i * height // count // 2
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(photo[y : y + height, x : x + width]), "rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def sequential_decode() -> mock._patch:
    """A context in which files are decoded frame after frame up to the last frame sampled (the path before
    2026-11-28's seeks): every file's seeking is off from the start."""
    return mock.patch.object(video._FileFrames, "seeks", False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default=f"cpu ({os.cpu_count()} cores)", help="the machine, in words")
    args = parser.parse_args()

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import load_video

    meta = cpu_meta(args.device, ("numpy", "av", "torch", "torchvision", "torchcodec", "transformers"))
    processor = Qwen3VLVideoProcessor(cap_pixels_per_frame=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for (height, width), gop in [(size, gop) for size in ((720, 1280), (1080, 1920)) for gop in (None, 30)]:
            clip = write_clip(Path(tmp) / f"{height}p-{gop}.mp4", height, width, args.seconds, gop=gop)
            for sampled, sampling in SAMPLINGS.items():
                hf_sampling = {"fps": None, **sampling} if sampling else {}  # HF refuses fps and num_frames together
                sample = functools.partial(processor.sample_frames, **hf_sampling)

                def hf_decode(clip=clip, sample=sample):
                    return load_video(str(clip), backend="pyav", sample_indices_fn=sample)[0]

                frames = hf_decode()

                def hf_process(frames=frames):
                    return processor(videos=[frames], do_sample_frames=False, return_tensors="np")

                def hf_all(hf_decode=hf_decode):
                    return processor(videos=[hf_decode()], do_sample_frames=False, return_tensors="np")

                def hf_torchcodec(clip=clip, hf_sampling=hf_sampling):
                    return processor(videos=[str(clip)], do_sample_frames=True, return_tensors="np", **hf_sampling)

                def ours(clip=clip, sampling=sampling):
                    return preprocess_video(clip, **sampling)

                def sequential(ours=ours):
                    with sequential_decode():
                        return ours()

                def numpy_only(ours=ours):
                    with numpy_resize():
                        return ours()

                rows_ours, grid = ours()
                for ref in (hf_process(), hf_torchcodec()):
                    assert np.array_equal(rows_ours, ref["pixel_values_videos"])
                    assert np.array_equal(grid, ref["video_grid_thw"])
                assert np.array_equal(sequential()[0], rows_ours) and np.array_equal(numpy_only()[0], rows_ours)
                keyframes = f"keyframe every {gop} frames" if gop else "x264's keyframe interval"
                workload = f"{args.seconds:g}s {width}x{height} h264 30fps, {keyframes}, {sampled}"
                for impl, part, fn in (
                    ("hf", "decode", hf_decode),
                    ("hf", "process", hf_process),
                    ("hf", "end_to_end", hf_all),
                    ("hf_torchcodec", "end_to_end", hf_torchcodec),
                    ("vitjax", "end_to_end", ours),
                    ("vitjax_sequential", "end_to_end", sequential),
                    ("vitjax_numpy_resize", "end_to_end", numpy_only),
                ):
                    seconds, times = median_time(fn, args.reps)
                    ms, times = seconds * 1e3, [t * 1e3 for t in times]
                    row = {**meta, "script": "bench_video", "workload": workload, "grid_thw": grid[0].tolist()}
                    rows.append({**row, "impl": impl, "part": part, "ms": ms, "ms_all": [round(t, 1) for t in times]})
                    print(json.dumps(rows[-1]), flush=True)
    save_rows(rows, args.out, "video", {"workload": 75, "impl": 19, "part": 11})


if __name__ == "__main__":
    main()
