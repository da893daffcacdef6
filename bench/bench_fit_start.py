"""What a fitted bucket's background compile costs the calls served beside it (`vitjax.engine.Engine`): the call
that starts it (the second of a size) and the three after it, against the same request with no compile running,
with Python's switch interval during the compile at each of `--intervals` (ms; 5 is Python's default, the path
before `vitjax.engine.FIT_SWITCH_INTERVAL`). `ladder_calls_extra_ms` sums what the starting call and those of the next
calls that still ran in the ladder's bucket took over the quiet median (later ones run in the fitted bucket, faster).

The 8B tower, random weights, bf16, float32 pixel rows from the host like bench_vit's `encode_patches` rows. Each
round the engine forgets its fitted buckets, so the compile runs again: from the second round on XLA's part comes
from the persistent cache and the compile is mostly the tracing in Python, the part that holds Python's lock. Rounds
rotate the order of the intervals. One JSON line per (workload, interval, round) in bench/results/<device>-<date>.jsonl.

    PYTHONPATH=. python bench/bench_fit_start.py [--attention fa4] [--intervals 5,0.5,0.1] [--rounds 3]
    OUT=/tmp/out bash bench/run_attn_gpu.sh unpack fit      # with fa4 carried (.fa4/), as measured
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from bench_attention import recorder, rotating_rounds  # bench/ is on sys.path when run as a script
from bench_vit import PRESET, _timed, workloads

import vitjax
from vitjax import buckets

WORKLOADS = ("4x720p", "8x720p", "16x720p", "32x720p", "4x2k", "20x960x1280")  # of bench_vit's, all fitted
QUIET_CALLS = 5
NEXT_CALLS = 3


def forget_fitted(engine: vitjax.engine.Engine) -> None:
    """Back to no fitted bucket and no sightings, so the next two calls of a size start its compile again."""
    engine.settle()
    for key in [*engine._fitted, *engine._fitting]:
        engine._executables.pop(key, None)
    engine._fitted.clear()
    engine._fitting.clear()
    engine._sightings.clear()
    engine._unfit.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", help="attention path (default: the machine's choice)")
    ap.add_argument("--intervals", default="5,0.5,0.1", help="switch intervals during the compile, ms")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="tiny config and images: check the script on a CPU")
    args = ap.parse_args()
    _, emit = recorder("bench_fit_start", args.out)
    cfg, policy = vitjax.VisionConfig.preset(PRESET), None
    if args.smoke:
        cfg = vitjax.VisionConfig(2, 144, 2, 80, 48, (0,))
        policy = buckets.BucketPolicy(tokens=(1024, 8192), segments=(4, 32), granule=64, fit_granule=64)
    enc = vitjax.Encoder.random(cfg, attention=args.attention, buckets=policy)
    engine = enc.parallel.engines[0]
    compile_times = []
    compile_ = engine._compile

    def timed_compile(*key):
        start = time.perf_counter()
        try:
            return compile_(*key)
        finally:
            compile_times.append(time.perf_counter() - start)

    engine._compile = timed_compile
    pool = np.random.default_rng(0).standard_normal((131072, enc.cfg.patch_dim), dtype=np.float32)
    sizes = dict(workloads(True, args.smoke))
    for name in WORKLOADS:
        grids = np.array(sizes[name])
        pixels = pool[: int(np.prod(grids, axis=1).sum())]

        def call(pixels=pixels, grids=grids) -> float:
            return _timed(lambda: jax.block_until_ready(enc.encode_patches(pixels, grids))) * 1e3

        for _ in range(3):  # the ladder's bucket compiled and run, and a first fitted compile (cold, autotuning)
            call()
        quiet = []
        for _ in range(QUIET_CALLS):
            forget_fitted(engine)
            quiet.append(call())  # a first sighting: no compile
        base = float(np.median(quiet))
        for rnd, interval in rotating_rounds(args.intervals.split(","), args.rounds):
            vitjax.engine.FIT_SWITCH_INTERVAL = float(interval) / 1e3
            forget_fitted(engine)
            call()
            compile_times.clear()
            starting = call()
            after, fitted = [], []
            for _ in range(NEXT_CALLS):
                fitted.append(engine.settle(timeout=0))  # compiled: this call runs in the fitted bucket
                after.append(call())
            engine.settle()
            on_ladder = [t for t, done in zip(after, fitted, strict=True) if not done]
            emit(
                {
                    "workload": name,
                    "attention": enc.attention,
                    "switch_interval_ms": float(interval),
                    "round": rnd,
                    "quiet_ms": base,
                    "starting_ms": starting,
                    "next_ms": after,
                    "next_in_fitted": fitted,
                    "starting_extra_ms": starting - base,
                    "ladder_calls_extra_ms": starting + sum(on_ladder) - (1 + len(on_ladder)) * base,
                    "compile_s": compile_times[0],
                }
            )


if __name__ == "__main__":
    main()
