"""What a server's start costs: `Encoder.warmup()` over the default bucket set, cold and from the persistent cache.

The 8B tower (random weights, bf16, bf16 pixel rows as the SGLang bridge warms it) warms every bucket of the
policy in a fresh process with an empty compilation cache, then again in a second process reading that cache,
once per `--min-compile-s` (the shortest compile JAX persists, `vitjax.engine.CACHE_MIN_COMPILE_SECONDS`; JAX's own
default is 1 s), each with its own cache. Each bucket's seconds are one JSON line (printed and
appended to bench/results/<device>-<date>.jsonl), then each process's sums; `--ladder` names the buckets a
segment ladder would not have (`new`), and those the default set had before 2026-11-26 (`in_earlier_set`), so the
rows also price a change of ladder or set. `--paths previous` repeats the pair on an earlier code path
(`bench_vit.PATHS`). `--devices 1,2` repeats it on a data-parallel encoder over that many GPUs (each engine
compiles its own executables, the engines side by side); the sums carry JAX's cache hits and misses and the
warm-up's wall time. `--every n` warms every n-th bucket only.

    PYTHONPATH=. python bench/bench_warmup.py [--ladder 1,4,16,64] [--min-compile-s 1,0.2] [--paths shipped,previous]
        [--devices 1,2] [--every 4]
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


def child(min_compile_s: float, path: str, devices: int, every: int) -> None:
    """One process: build the tower on `devices` GPUs (data parallel), warm every `every`-th default bucket, print
    the seconds per bucket and JAX's persistent-cache hits and misses."""
    start = time.perf_counter()
    from bench_vit import code_path
    from jax import monitoring

    import vitjax
    from vitjax import buckets

    counts = {"/jax/compilation_cache/cache_hits": 0, "/jax/compilation_cache/cache_misses": 0}

    def listen(event: str, **_) -> None:
        if event in counts:
            counts[event] += 1

    monitoring.register_event_listener(listen)
    vitjax.engine.CACHE_MIN_COMPILE_SECONDS = min_compile_s
    with code_path(path):
        enc = vitjax.Encoder.random(PRESET, devices=devices)
        built = time.perf_counter() - start
        start = time.perf_counter()
        times = enc.warmup(buckets.BucketPolicy().buckets()[::every], pixel_dtype="bfloat16")
        wall = time.perf_counter() - start
    hits, misses = counts.values()
    found = {"built_s": built, "wall_s": wall, "cache_hits": hits, "cache_misses": misses}
    print("TIMES " + json.dumps({**found, "buckets": [[*b, s] for b, s in times.items()]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ladder", default="1,4,16,64", help="the segment ladder to compare with (its buckets: new=false)")
    ap.add_argument("--min-compile-s", default="1,0.2", help="thresholds to compare, comma-separated")
    ap.add_argument("--paths", default="shipped", help="code paths to compare, comma-separated (bench_vit.PATHS)")
    ap.add_argument("--devices", default="1", help="data-parallel GPU counts to compare, comma-separated")
    ap.add_argument("--every", type=int, default=1, help="warm every n-th bucket of the default set only")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--child", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if args.child is not None:
        child(args.child, args.paths, int(args.devices), args.every)
        return
    from bench_attention import recorder

    from vitjax.buckets import MIN_FRAME_TOKENS, BucketPolicy

    _, emit = recorder("bench_warmup", args.out)
    old = set(BucketPolicy(segments=tuple(map(int, args.ladder.split(",")))).buckets())
    # The default set before 2026-11-26: only rungs whose every slot could hold a frame of MIN_FRAME_TOKENS patches.
    earlier = {b for b in BucketPolicy().buckets() if b.segments == 1 or b.segments * MIN_FRAME_TOKENS <= b.tokens}
    runs = [
        (float(v), t, int(n), c)
        for n in args.devices.split(",")
        for t in args.paths.split(",")
        for v in args.min_compile_s.split(",")
        for c in ("cold", "warm")
    ]
    for threshold, path, devices, cache in runs:
        if cache == "cold":
            env = {**os.environ, "VITJAX_CACHE_DIR": tempfile.mkdtemp(prefix="vitjax-warmup-")}
        command = [sys.executable, __file__, "--child", str(threshold), "--paths", path, "--devices", str(devices)]
        command += ["--every", str(args.every)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("TIMES ")), None)
        if line is None:
            raise SystemExit(f"the {cache} warm-up failed:\n{proc.stderr[-3000:]}")
        found = json.loads(line[6:])
        same = {"cache": cache, "min_compile_s": threshold, "devices": devices, "every": args.every}
        rows = [
            {
                **same,
                **({} if path == "shipped" else {"path": path}),
                "tokens": t,
                "segments": s,
                "s": secs,
                "new": (t, s) not in old,
                "in_earlier_set": (t, s) in earlier,
            }
            for t, s, secs in found["buckets"]
        ]
        new = [r["s"] for r in rows if r["new"]]
        summary = {
            **same,
            **({} if path == "shipped" else {"path": path}),
            **{k: found[k] for k in ("built_s", "wall_s", "cache_hits", "cache_misses")},
            "buckets": len(rows),
            "total_s": sum(r["s"] for r in rows),
        }
        summary.update(new_buckets=len(new), new_s=sum(new), ladder_compared=args.ladder)
        added = [r["s"] for r in rows if not r["in_earlier_set"]]
        summary.update(buckets_not_in_earlier_set=len(added), not_in_earlier_set_s=sum(added))
        summary["cache_files"] = sum(1 for f in Path(env["VITJAX_CACHE_DIR"]).rglob("*") if f.is_file())
        for row in [*rows, summary]:
            emit(row)


if __name__ == "__main__":
    main()
