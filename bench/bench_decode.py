"""JPEG bytes -> pixel rows: PIL (threads) against NVIDIA DALI on the CPU and on the GPU, in one run.

The workload of DESIGN.md's decode row: 20 distinct JPEGs of 960x1280 (bench_encode's `jpegs`), through
`vitjax.pipeline.Pipeline` as `Encoder.encode` drives it: prepare every input (PIL: decode and hash the pixels;
DALI: read the header and hash the file), then fill one batch of rows [98,304, 1536] float32 (decode, resize,
patchify, normalize). Variants: PIL in threads (bit-identical to HF; on a GPU also with the rows' upload), DALI's
CPU backend, and on a GPU DALI's mixed backend with the hardware JPEG decoder off, at DALI's default share
(0.65) and for the whole batch. DALI's own run (the filled batch alone, prepare excluded) is timed too, and each
variant's rows are compared with PIL's (max and mean absolute difference). 960x1280 needs no resize (both sides
are multiples of 32); `--size 1000x1333` makes every image resize along both axes.

    PYTHONPATH=. python bench/bench_decode.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_encode import jpegs  # noqa: E402
from bench_vit import median_time, results_file, versions  # noqa: E402

import vitjax  # noqa: E402
from vitjax import dali  # noqa: E402
from vitjax.pipeline import Pipeline  # noqa: E402
from vitjax.preprocess import MAX_PIXELS, MIN_PIXELS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--size", default="960x1280", help="width x height of the JPEGs (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args()

    cfg = vitjax.VisionConfig.preset("qwen3-vl-8b")  # any Qwen3-VL: patch 16, merge 2, temporal 2
    size = tuple(int(v) for v in args.size.split("x"))
    inputs = [(f"<bytes #{i}>", data) for i, data in enumerate(jpegs(args.images, size))]
    gpu = next((d for d in jax.local_devices() if d.platform == "gpu"), None)
    meta = versions()
    meta["dali"] = _dali_version()
    rows = []

    def emit(row: dict) -> None:
        rows.append({**meta, "bench": "decode", "workload": f"{args.images}x{args.size} jpeg", **row})
        print(json.dumps(rows[-1]), flush=True)

    def pipeline(runner: dali.DaliRows | None) -> Pipeline:
        kw = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "pixel_dtype": np.float32, "workers": args.threads}
        return Pipeline(cfg, dali=runner, **kw)

    def end_to_end(runner: dali.DaliRows | None, upload: bool = False):
        with pipeline(runner) as pipe:
            pixels, errors = pipe.fill(list(pipe.prepare(inputs)))
        assert errors == [None] * len(inputs)
        if upload:
            pixels = jax.device_put(pixels, gpu)
        return jax.block_until_ready(pixels)

    reference = end_to_end(None)
    variants: list[tuple[str, dali.DaliRows | None, dict]] = [("pil", None, {})]
    if gpu is not None:
        variants.append(("pil+upload", None, {"upload": True}))
    if dali.available():
        variants.append(("dali-cpu", dali.DaliRows(cfg, None, threads=args.threads), {}))
        if gpu is not None:
            for load in (0.0, dali.HW_DECODER_LOAD, 1.0):
                runner = dali.DaliRows(cfg, gpu, threads=args.threads, hw_decoder_load=load)
                variants.append((f"dali-gpu-hw{load:g}", runner, {"hw_decoder_load": load}))
    for name, runner, extra in variants:
        t, times = median_time(
            lambda runner=runner, extra=extra: end_to_end(runner, extra.get("upload", False)), args.reps
        )
        diff = np.abs(np.asarray(end_to_end(runner, extra.get("upload", False))) - reference)
        row = {"impl": name, "part": "prepare+fill", "ms": t * 1e3, "ms_all": [round(v * 1e3, 2) for v in times]}
        emit({**row, "threads": args.threads, "max_abs": float(diff.max()), "mean_abs": float(diff.mean()), **extra})
        if runner is not None:  # DALI's run alone, on samples prepared once
            with pipeline(runner) as pipe:
                samples = [item.sample() for item in pipe.prepare(inputs)]
            t, times = median_time(
                lambda runner=runner, samples=samples: jax.block_until_ready(runner(samples)), args.reps
            )
            emit(
                {"impl": name, "part": "dali_run", "ms": t * 1e3, "ms_all": [round(v * 1e3, 2) for v in times], **extra}
            )

    args.out.mkdir(parents=True, exist_ok=True)
    path = results_file(args.out, meta)
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{'impl':18} {'part':14} {'ms':>9}  {'max_abs':>8} {'mean_abs':>9}")
    for r in rows:
        nan = float("nan")
        print(
            f"{r['impl']:18} {r['part']:14} {r['ms']:9.1f}  {r.get('max_abs', nan):8.4f} {r.get('mean_abs', nan):9.2e}"
        )


def _dali_version() -> str | None:
    if not dali.available():
        return None
    import nvidia.dali

    return nvidia.dali.__version__


if __name__ == "__main__":
    main()
