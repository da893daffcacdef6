"""Video files in, pixel rows out, on the CPU: vitjax `preprocess_video` against HF (PyAV reader + processor).

The workload: a clip made from a shipped photograph, panned (H.264, yuv420p, 30 fps), at 1280x720 and
1920x1080, sampled at HF's default 2 frames per second (processor defaults, per-frame cap on). HF: its
`load_video(backend="pyav")` with the processor's `sample_frames`, then the processor (torchvision's resize on
the CPU). vitjax: `preprocess_video(path)` (decode with PyAV's frame threads, resize each temporal group as it
is decoded with `vitjax.resize`: PyTorch's kernel where installed and exact, as here). `vitjax_numpy_resize` is the
same with the numpy repetition of that kernel (the path without PyTorch, and the only one before 2026-11-28). All
produce the same rows (checked here, bit for bit); times are medians.

    PYTHONPATH=. python bench/bench_video.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import av
import numpy as np
from bench_vit import median_time
from cpu_bench import cpu_meta, numpy_resize
from PIL import Image

from vitjax.preprocess import preprocess_video

PHOTO = Path(__file__).resolve().parents[1] / "tests" / "data" / "images" / "astronaut.jpg"


def write_clip(path: Path, height: int, width: int, seconds: float, rate: int = 30) -> Path:
    """A pan over the photo, upscaled so the window can move; frames differ in content as real video does."""
    photo = np.asarray(Image.open(PHOTO).convert("RGB").resize((width * 2, height * 2), Image.Resampling.BICUBIC))
    count = int(seconds * rate)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        for i in range(count):
            x, y = i * width // count, i * height // count // 2
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(photo[y : y + height, x : x + width]), "rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default=f"cpu ({os.cpu_count()} cores)", help="the machine, in words")
    args = parser.parse_args()

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import load_video

    meta = cpu_meta(args.device, ("numpy", "av", "torch", "torchvision", "transformers"))
    processor = Qwen3VLVideoProcessor(cap_pixels_per_frame=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for height, width in ((720, 1280), (1080, 1920)):
            clip = write_clip(Path(tmp) / f"{height}p.mp4", height, width, args.seconds)

            def hf_decode(clip=clip):
                return load_video(str(clip), backend="pyav", sample_indices_fn=processor.sample_frames)[0]

            frames = hf_decode()

            def hf_process(frames=frames):
                return processor(videos=[frames], do_sample_frames=False, return_tensors="np")

            def hf_all():
                return processor(videos=[hf_decode()], do_sample_frames=False, return_tensors="np")

            def numpy_only(clip=clip):
                with numpy_resize():
                    return preprocess_video(clip)

            ours, grid = preprocess_video(clip)
            ref = hf_process()
            assert np.array_equal(ours, ref["pixel_values_videos"]) and np.array_equal(grid, ref["video_grid_thw"])
            assert np.array_equal(numpy_only()[0], ours)
            workload = f"{args.seconds:g}s {width}x{height} h264 30fps, {len(frames)} frames sampled"
            for impl, part, fn in (
                ("hf", "decode", hf_decode),
                ("hf", "process", hf_process),
                ("hf", "end_to_end", hf_all),
                ("vitjax", "end_to_end", lambda clip=clip: preprocess_video(clip)),
                ("vitjax_numpy_resize", "end_to_end", numpy_only),
            ):
                seconds, times = median_time(fn, args.reps)
                ms, times = seconds * 1e3, [t * 1e3 for t in times]
                row = {**meta, "script": "bench_video", "workload": workload, "grid_thw": grid[0].tolist()}
                rows.append({**row, "impl": impl, "part": part, "ms": ms, "ms_all": [round(t, 1) for t in times]})
                print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / f"cpu-video-{meta['date']}.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for r in rows:
        print(f"{r['workload']:45} {r['impl']:19} {r['part']:11} {r['ms']:9.1f} ms")


if __name__ == "__main__":
    main()
