"""XLA's reference attention (the CPU's path, and float32 towers') on calls of many small frames, and its previous form.

The reference path once scored every query against every key of its call, masked to the query's frame, so a call of
many small frames cost the call's length squared. It now scores each block of queries against its own frames' keys
only. This script runs, in one process on the same inputs:
- the attention alone (8B's 16 heads at head_dim 72, float32) on one frame filling its call, and on many small frames
  in one call: the shipped path, and the previous one (`vitjax/attention.py` at `--previous`, read from git);
- a small tower (2 blocks, width 144, bf16) through `Encoder.encode_patches` on many small images and on one image,
  with both paths, beside HF's `Qwen3VLVisionModel` on the CPU (sdpa, bf16) on the same weights and pixel rows.

    PYTHONPATH=. python bench/bench_reference.py      # writes bench/results/cpu-<date>.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("VITJAX_CACHE_DIR", "off")  # each path compiles afresh, as a first run would

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import recorder  # noqa: E402
from bench_vit import flops, median_time, patched, run_hf  # noqa: E402

import vitjax  # noqa: E402
from vitjax import attention, layout  # noqa: E402
from vitjax.buckets import BucketPolicy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PREVIOUS = "63f7e85"  # the last commit with the dense reference path
CONFIG = vitjax.VisionConfig(2, 144, 2, 80, 48, (0,))  # bench_vit's smoke tower: 2 heads at head_dim 72
# (name, grids): frames of 96 to 238 patches, as small photos give at HF's default pixel budget floor and up
SMALL = [(1, 8 + 2 * (i % 4), 12 + 2 * (i % 5)) for i in range(300)]
TOWER = [("300 small images", SMALL), ("1 image of 64x64 patches", [(1, 64, 64)])]
ALONE = [
    ("1 frame of 1536", [(1, 32, 48)], 1536),
    ("1 frame of 4096", [(1, 64, 64)], 4096),
    ("64 frames of 240", [(1, 12, 20)] * 64, 16384),
]


def previous_reference(rev: str):
    """`_reference` as `vitjax/attention.py` had it at `rev`, called as today's is (q, k, v, segments)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:vitjax/attention.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    module = sys.modules[f"attention_{rev}"] = types.ModuleType(f"attention_{rev}")  # dataclasses look it up
    exec(compile(source, f"attention@{rev}", "exec"), module.__dict__)
    return lambda q, k, v, segments: module._reference(q, k, v, segments.ids)


def path(name: str, previous) -> contextlib.AbstractContextManager:
    """The encoders built and calls traced inside run the `name` path ("shipped" or "previous")."""
    return patched({(attention, "_reference"): previous} if name == "previous" else {})


def attention_alone(emit, previous, reps: int) -> None:
    heads, dim = 16, 72
    rng = np.random.default_rng(0)
    for name, grids, tokens in ALONE:
        packed = layout.pack(grids, tokens, max(4, len(grids)))
        segments = attention.Segments(*(jnp.asarray(a) for a in packed[3:]))
        q, k, v = (jnp.asarray(rng.standard_normal((tokens, heads, dim), np.float32)) for _ in range(3))
        real = packed.segment_ids >= 0
        outs = {}
        for label in ("shipped", "previous"):
            with path(label, previous):
                fn = jax.jit(functools.partial(attention.attention, segments=segments, impl="reference"))
                outs[label] = np.asarray(fn(q, k, v))
                t, times = median_time(lambda fn=fn, qkv=(q, k, v): fn(*qkv).block_until_ready(), reps)
            work = 4 * heads * dim * sum(h * w * h * w for _, h, w in grids)
            emit(
                {
                    "part": "attention",
                    "path": label,
                    "workload": name,
                    "tokens": tokens,
                    "ms": t * 1e3,
                    "ms_all": [round(x * 1e3, 2) for x in times],
                    "gflops": work / t / 1e9,
                }
            )
        diff = np.abs(outs["shipped"][real] - outs["previous"][real]).max()
        emit({"part": "attention", "workload": name, "max_abs_diff_shipped_previous": float(diff)})


def towers(emit, previous, reps: int) -> None:
    pool = np.random.default_rng(1).standard_normal((sum(h * w for _, h, w in SMALL), CONFIG.patch_dim), np.float32)
    with tempfile.TemporaryDirectory(prefix="vitjax-bench-") as work:
        weights = Path(work)
        run_hf(CONFIG, weights, TOWER, pool, lambda row: emit({"part": "tower", **row}))
        for label in ("shipped", "previous"):
            with path(label, previous):
                enc = vitjax.Encoder.from_pretrained(weights)
                for name, grids in TOWER:
                    tokens = sum(h * w for _, h, w in grids)
                    x, grid = pool[:tokens], np.asarray(grids)

                    def call(x=x, grid=grid, enc=enc):
                        jax.block_until_ready(enc.encode_patches(x, grid))

                    t, times = median_time(call, reps)
                    gemm, attn = flops(CONFIG, grids)
                    emit(
                        {
                            "part": "tower",
                            "impl": "vitjax",
                            "path": label,
                            "workload": name,
                            "images": len(grids),
                            "patches": tokens,
                            "buckets": [list(b) for b, _ in BucketPolicy().plan(grids)],
                            "ms": t * 1e3,
                            "ms_all": [round(v * 1e3, 2) for v in times],
                            "tflops": (gemm + attn) / t / 1e12,
                        }
                    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--previous", default=PREVIOUS, help="the git revision whose reference path is the baseline")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default="attention,tower", help="which parts to run, comma-separated")
    args = ap.parse_args()
    _, record = recorder("bench_reference", args.out)

    def emit(row: dict) -> None:
        record({"previous": args.previous, **row})

    previous = previous_reference(args.previous)
    parts = args.parts.split(",")
    if "attention" in parts:
        attention_alone(emit, previous, args.reps)
    if "tower" in parts:
        towers(emit, previous, args.reps)


if __name__ == "__main__":
    main()
