"""fa4's Hopper forward at head_dim 72 under other schedules than upstream's (FA3's table: 192 x 144, P through
shared memory), beside cuDNN packed, on the tower's attention workloads (`bench_attention.CASES`).

Two phases on one GPU. First every schedule is built and checked against the fp32 reference in a process of
its own, several at a time (a schedule that fails to compile or faults takes only its process down; the built
kernels land in cutejax's disk cache). Then one process times every schedule that passed, with cuDNN packed, in
rounds of rotating order (`bench_attention.rotating_rounds`; their spread is the noise): forward, bf16, 16 heads,
back-to-back calls.

    PYTHONPATH=. python bench/bench_fa4_tiles.py [--variants 192x144ss,192x112rs3] [--jobs 6] [--rounds 3]

One JSON object per line, also appended to bench/results/<device>-<date>.jsonl; a table last, fastest first.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the check processes share the GPU
import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import (
    CASES,
    HEADS,
    errors,
    pipelined_ms,
    random_qkv,
    recorder,
    reference,
    rotating_rounds,
    run_fn,
    segments,
)

from vitjax import fa4  # noqa: E402

HEAD_DIM = 72
# upstream first (FA3's table, the baseline), the shipped schedule (`fa4.FA4_TILES`), 3 MMA warpgroups with P
# in shared memory, and with P in registers at up to 112 keys a step (192 x 128 with P in registers spills at head_dim
# 72), FA3's head_dim-128 family (2 warpgroups, P in registers, wider key steps; 128 x 240 spills), and deeper K/V
# pipelines. All of these compile without spills for sm_90a (ptxas, offline).
VARIANTS = (
    "192x144ss,192x112rs3,192x112ss,192x128ss,192x160ss,192x176ss,192x144ss3,192x112rs,192x112rs4,192x96rs,"
    "192x96rs4,128x128rs,128x144rs,128x160rs,128x176rs,128x192rs,128x208rs,128x224rs,128x176rs3,128x192ss"
)
CHECK_GRIDS = ([(1, 38, 54), (2, 20, 26), (1, 2, 2), (1, 46, 30)], 8), ([(1, 44, 80)], 1)


def check(name: str) -> dict:
    """Build one schedule and hold it against the fp32 reference: odd frames with unused slots and tail padding,
    one frame in a one-slot bucket, and NaN in the padding rows (real rows must not see it)."""
    fa4.set_fa4_tile(HEAD_DIM, fa4.Fa4Tile.parse(name))
    start = time.perf_counter()
    worst = {"max_abs_err": 0.0, "rel_l2_err": 0.0, "finite": True}
    for n, (grids, slots) in enumerate(CHECK_GRIDS):
        q, k, v = random_qkv(100 + n, 6144, HEAD_DIM)
        seg = segments(grids, 6144, slots)
        real = np.asarray(seg.ids) >= 0
        poison = jax.numpy.asarray(~real)[:, None, None]
        fn = run_fn("fa4", seg)
        ref = reference(seg, q, k, v, fn)
        for inputs in ((q, k, v), tuple(jax.numpy.where(poison, jax.numpy.nan, x) for x in (q, k, v))):
            e = errors(fn(*inputs), ref, real)
            worst = {
                "max_abs_err": max(worst["max_abs_err"], e["max_abs_err"]),
                "rel_l2_err": max(worst["rel_l2_err"], e["rel_l2_err"]),
                "finite": worst["finite"] and e["finite"],
            }
    return {"variant": name, "build_and_check_s": round(time.perf_counter() - start, 1), **worst}


def checked(names: list[str], jobs: int, limit: int, emit) -> list[str]:
    """Run `check` for each schedule in its own process, `jobs` at a time; the names that passed, in order."""

    def one(name: str) -> dict:
        cmd = [sys.executable, __file__, "--check", name]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"variant": name, "error": f"no result in {limit} s"}
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("CHECK ")), None)
        if line is None:
            return {"variant": name, "error": (proc.stderr or proc.stdout)[-1500:]}
        return json.loads(line[6:])

    passed = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for row in pool.map(one, names):
            ok = "error" not in row and row["finite"] and row["max_abs_err"] < 0.03
            emit({"bench": "fa4_tile_check", "passed": ok, **row})
            if ok:
                passed.append(row["variant"])
    return passed


def timing(names: list[str], rounds: int, emit) -> None:
    """Every schedule (and cuDNN packed) on every workload, `rounds` rounds in rotating order, one process."""
    runs: dict[str, dict] = {}
    for name in [*names, "cudnn_packed"]:
        impl = "cudnn_packed" if name == "cudnn_packed" else "fa4"
        if impl == "fa4":
            fa4.set_fa4_tile(HEAD_DIM, fa4.Fa4Tile.parse(name))
        runs[name] = {}
        for case, (grids, tokens, slots) in CASES.items():
            seg = segments(grids, tokens, slots)
            fn = run_fn(impl, seg)
            jax.block_until_ready(fn(*random_qkv(0, tokens, HEAD_DIM)))  # traced now, with this schedule
            runs[name][case] = fn
    for case, (grids, tokens, slots) in CASES.items():
        qkv = random_qkv(HEAD_DIM, tokens, HEAD_DIM)
        seg = segments(grids, tokens, slots)
        real = np.asarray(seg.ids) >= 0
        useful = sum(t * (h * w) ** 2 for t, h, w in grids)
        acc = {name: errors(fns[case](*qkv), reference(seg, *qkv, fns[case]), real) for name, fns in runs.items()}
        for rnd, name in rotating_rounds(list(runs), rounds):
            ms = pipelined_ms(runs[name][case], *qkv)
            row = {"bench": "fa4_tile", "frames": case, "variant": name, "head_dim": HEAD_DIM, "round": rnd}
            tflops = 4 * HEADS * HEAD_DIM * useful / ms / 1e9
            row.update(ms_pipelined=round(ms, 3), tflops_pipelined=round(tflops, 1))
            emit({**row, **acc[name]})


def table(rows: list[dict]) -> str:
    times: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.get("bench") == "fa4_tile":
            times.setdefault((r["variant"], r["frames"]), []).append(r["ms_pipelined"])
    names = sorted({v for v, _ in times}, key=lambda v: np.median(times.get((v, "20x4800"), [1e9])))
    lines = [f"{'variant':<14}" + "".join(f"{c + ' ms (min-max)':>28}" for c in CASES)]
    for v in names:
        cells = []
        for c in CASES:
            t = times.get((v, c), [])
            cells.append(f"{np.median(t):>10.3f} ({min(t):.3f}-{max(t):.3f})" if t else f"{'-':>28}")
        lines.append(f"{v:<14}" + "".join(f"{c:>28}" for c in cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=VARIANTS, help="fa4 tiles (vitjax.fa4.Fa4Tile), comma-separated")
    ap.add_argument("--jobs", type=int, default=6, help="schedules built and checked at the same time")
    ap.add_argument("--check-limit", type=int, default=300, help="seconds one schedule may take to build and check")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--check", metavar="VARIANT", help=argparse.SUPPRESS)  # the per-schedule worker
    args = ap.parse_args()
    if args.check:
        print("CHECK " + json.dumps(check(args.check)), flush=True)
        return
    rows, emit = recorder("bench_fa4_tiles", args.out)
    passed = checked([v.strip() for v in args.variants.split(",")], args.jobs, args.check_limit, emit)
    timing(passed, args.rounds, emit)
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
