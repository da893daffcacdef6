"""cuDNN's padded-batch path on a request of one large photo and many small ones: device memory and time, with the
request cut as `BucketPolicy.plan(..., padded=True)` cuts it and as one call (the plan before that cut).

The padded batch gives every slot of a call the length of its longest frame, so one 16.7 MP photo (65,536 patches)
among 19 photos of 1,520 patches was one call of 64 slots x 65,536 rows. Each path runs in a process of its own (the
device's peak memory is per process), on the 8B config with random bf16 weights; the 20 photos of 960x1280 run too,
which no cut changes.

    python bench/bench_padded.py --out bench/results      # GPU; one JSON line per path and workload
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "1x16.7MP+19x1520": [(1, 256, 256)] + [(1, 40, 38)] * 19,
    "20x960x1280": [(1, 60, 80)] * 20,
}
PATHS = ("cut", "one_call")


def measure(path: str, workload: str, calls: int) -> dict:
    """Runs in the child: one path on one workload; median ms of `calls` calls after a first, and the peak memory."""
    import jax
    import jax.numpy as jnp
    from bench_vit import flops, versions

    import vitjax
    from vitjax.buckets import BucketPolicy

    if path == "one_call":  # the plan before padded calls were cut
        whole = BucketPolicy.plan
        BucketPolicy.plan = lambda self, grids, padded=False: whole(self, grids)
    # The ladder's buckets only: a fitted bucket's background compile would run beside the timed calls.
    policy = BucketPolicy(fit_granule=0)
    enc = vitjax.Encoder.random("qwen3-vl-8b", attention="cudnn_padded", cache_bytes=0, buckets=policy)
    grids = WORKLOADS[workload]
    rows = sum(t * h * w for t, h, w in grids)
    pixels = jax.device_put(np.random.default_rng(0).standard_normal((rows, 1536), np.float32).astype(jnp.bfloat16))
    plan = [(tuple(b), len(c)) for b, c in enc.parallel.engines[0].policy.plan(grids, padded=True)]
    row = {**versions(), "bench": "padded", "path": path, "workload": workload, "plan": plan}
    try:
        jax.block_until_ready(enc.encode_patches(pixels, np.array(grids)))
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            jax.block_until_ready(enc.encode_patches(pixels, np.array(grids)))
            times.append(time.perf_counter() - start)
        ms = 1e3 * float(np.median(times))
        gemm, attn = flops(enc.cfg, grids)
        row.update(ms=ms, tflops=(gemm + attn) / ms / 1e9)
    except Exception as e:  # out of device memory: the row says so
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row["peak_gib"] = jax.devices()[0].memory_stats()["peak_bytes_in_use"] / 2**30
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--child", nargs=2, metavar=("PATH", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child, args.calls)))
        return
    from bench_vit import results_file, versions

    out = results_file(args.out, versions())
    for workload in WORKLOADS:
        for path in PATHS:
            child = [sys.executable, __file__, "--child", path, workload, "--calls", str(args.calls)]
            env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
            done = subprocess.run(child, capture_output=True, text=True, env=env, timeout=600)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if not lines:
                print(f"{path} {workload}: exit {done.returncode}\n{done.stderr[-2000:]}")
                continue
            row = json.loads(lines[-1])
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            shown = row.get("error") or f"{row['ms']:.1f} ms, {row['tflops']:.0f} TFLOP/s"
            print(f"{workload:>18} {path:>9}: {shown}; peak {row['peak_gib']:.2f} GiB; plan {row['plan']}")


if __name__ == "__main__":
    main()
