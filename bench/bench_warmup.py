"""What a server's start costs: `Encoder.warmup()` over the default bucket set, cold and from the persistent cache.

The 8B tower (random weights, bf16, bf16 pixel rows as the SGLang bridge warms it) warms every bucket of the
policy in a fresh process with an empty compilation cache, then again in a second process reading that cache,
once per `--min-compile-s` (the shortest compile JAX persists, `buckets.CACHE_MIN_COMPILE_SECONDS`; JAX's own
default is 1 s), each with its own cache. Each bucket's seconds are one JSON line (printed and
appended to bench/results/<device>-<date>.jsonl), then each process's sums; `--ladder` names the buckets a
segment ladder would not have (`new`), so the rows also price a change of ladder. `--taps spare_slot` repeats the
pair with the deepstack tap write vitjax had before `vitjax.taps` (`bench_vit.TAP_PATHS`).

    PYTHONPATH=. python bench/bench_warmup.py [--ladder 1,4,16,64] [--min-compile-s 1,0.2] [--taps shipped,spare_slot]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESET = "qwen3-vl-8b"


def child(min_compile_s: float, taps: str) -> None:
    """One process: build the tower, warm every default bucket, print the seconds per bucket."""
    start = time.perf_counter()
    from bench_vit import TAP_PATHS

    import vitjax
    from vitjax import buckets
    from vitjax.model import VisionTower

    buckets.CACHE_MIN_COMPILE_SECONDS = min_compile_s
    VisionTower.run_blocks = TAP_PATHS[taps]

    enc = vitjax.Encoder.random(PRESET)
    built = time.perf_counter() - start
    times = enc.warmup(pixel_dtype="bfloat16")
    print("TIMES " + json.dumps({"built_s": built, "buckets": [[*b, s] for b, s in times.items()]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ladder", default="1,4,16,64", help="the segment ladder to compare with (its buckets: new=false)")
    ap.add_argument("--min-compile-s", default="1,0.2", help="thresholds to compare, comma-separated")
    ap.add_argument("--taps", default="shipped", help="tap writes to compare, comma-separated (bench_vit.TAP_PATHS)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--child", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if args.child is not None:
        child(args.child, args.taps)
        return
    from bench_attention import recorder

    from vitjax.buckets import BucketPolicy

    _, emit = recorder("bench_warmup", args.out)
    old = set(BucketPolicy(segments=tuple(map(int, args.ladder.split(",")))).buckets())
    pairs = [(float(v), t) for t in args.taps.split(",") for v in args.min_compile_s.split(",")]
    for threshold, taps, cache in ((v, t, c) for v, t in pairs for c in ("cold", "warm")):
        if cache == "cold":
            env = {**os.environ, "VITJAX_CACHE_DIR": tempfile.mkdtemp(prefix="vitjax-warmup-")}
        command = [sys.executable, __file__, "--child", str(threshold), "--taps", taps]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("TIMES ")), None)
        if line is None:
            raise SystemExit(f"the {cache} warm-up failed:\n{proc.stderr[-3000:]}")
        found = json.loads(line[6:])
        rows = [
            {
                "cache": cache,
                "min_compile_s": threshold,
                **({} if taps == "shipped" else {"taps": taps}),
                "tokens": t,
                "segments": s,
                "s": secs,
                "new": (t, s) not in old,
            }
            for t, s, secs in found["buckets"]
        ]
        new = [r["s"] for r in rows if r["new"]]
        summary = {
            "cache": cache,
            "min_compile_s": threshold,
            **({} if taps == "shipped" else {"taps": taps}),
            "built_s": found["built_s"],
            "buckets": len(rows),
            "total_s": sum(r["s"] for r in rows),
        }
        summary.update(new_buckets=len(new), new_s=sum(new), ladder_compared=args.ladder)
        summary["cache_files"] = sum(1 for f in Path(env["VITJAX_CACHE_DIR"]).rglob("*") if f.is_file())
        for row in [*rows, summary]:
            emit(row)


if __name__ == "__main__":
    main()
