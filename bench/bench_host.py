"""Where the host holds a device-resident tower call back (one GPU): the time from `Engine.run`'s start to the
call's first device op, and what the host does meanwhile.

`bench_timeline.py` shows the GPU idle ~3 ms per 20-photo call and ~1.5 ms per 720p call outside its ops. Here the
8B tower (random bf16 weights, fa4, ladder buckets) runs device-resident pixels under JAX's profiler with each
call inside a named host annotation; per workload: wall and dispatch medians; per profiled call the lead (run start
→ first device op), the tail (last device op → call returned), busy time; then, traced again with Python's calls
(slower), the host events of one call (Python functions and XLA's own spans: execute, thunks, command buffers,
custom calls) summed by name; and cProfile's top
functions over `Engine.run`. One JSON object per line; the raw events of one call per workload go to
`<out>/host-events-<workload>.json`.

    PYTHONPATH=. python bench/bench_host.py --out bench/results
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gzip
import io
import json
import pstats
import re
import tempfile
from pathlib import Path

import jax
import numpy as np
from bench_attention import recorder  # bench/ is on sys.path when run as a script
from bench_timeline import WORKLOADS, device_request, dispatch_and_wall

import vitjax
from vitjax.buckets import BucketPolicy

CALLS = 4


def trace_events(call, calls: int, python: bool) -> list[dict]:
    """Every complete event (host and device) of `calls` runs of `call`, each run inside annotation `call<i>`;
    with `python`, Python's function calls too (which slows the host)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = int(python)
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True, profiler_options=options):
            for i in range(calls):
                with jax.profiler.TraceAnnotation(f"call{i}"):
                    call()
        trace = json.loads(gzip.decompress(next(Path(folder).rglob("perfetto_trace.json.gz")).read_bytes()))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        process = names.get((e.get("pid"), None), "")
        out.append(
            {
                "gpu": "GPU" in process or "gpu" in process,
                "line": names.get((e["pid"], e.get("tid")), "?"),
                "name": e["name"],
                "ts": float(e["ts"]),
                "dur": float(e.get("dur", 0)),
            }
        )
    return sorted(out, key=lambda e: e["ts"])


def per_call(events: list[dict], calls: int) -> tuple[list[dict], list[list[dict]]]:
    """Per annotated call: lead, tail, busy, span; and its events (host events of any thread inside its window,
    device ops from its start to the next call's start)."""
    marks = sorted((e for e in events if re.fullmatch(r"call\d+", e["name"])), key=lambda e: e["ts"])
    stats, windows = [], []
    for i, m in enumerate(marks):
        start, end = m["ts"], m["ts"] + m["dur"]
        limit = marks[i + 1]["ts"] if i + 1 < len(marks) else float("inf")
        ops = [e for e in events if e["gpu"] and start <= e["ts"] < limit]
        host = [e for e in events if not e["gpu"] and start <= e["ts"] <= end and e is not m]
        busy, last = 0.0, start
        for e in ops:
            busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], last))
            last = max(last, e["ts"] + e["dur"])
        first = ops[0]["ts"] if ops else end
        stats.append(
            {
                "wall_ms": (end - start) / 1e3,
                "lead_ms": (first - start) / 1e3,
                "first_op": ops[0]["name"][:60] if ops else None,
                "tail_ms": (end - last) / 1e3,
                "busy_ms": busy / 1e3,
                "ops": len(ops),
            }
        )
        windows.append(sorted(host + ops, key=lambda e: e["ts"]))
    return stats, windows


def host_summary(window: list[dict], start: float, first_op: float) -> list[dict]:
    """Host events of one call by name: count, total ms, and ms before the first device op."""
    acc = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in window:
        if e["gpu"]:
            continue
        key = re.sub(r"\d+", "#", e["name"])[:80]
        acc[key][0] += 1
        acc[key][1] += e["dur"] / 1e3
        acc[key][2] += max(0.0, min(e["ts"] + e["dur"], first_op) - max(e["ts"], start)) / 1e3
    top = sorted(acc.items(), key=lambda kv: -kv[1][1])[:30]
    return [{"name": k, "count": n, "ms": round(ms, 3), "ms_before_first_op": round(pre, 3)} for k, (n, ms, pre) in top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", default=None, help="the tower's attention path (default: the automatic one)")
    ap.add_argument("--smoke", action="store_true", help="a tiny config, to check the script on a CPU")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    _, emit = recorder("bench_host", args.out)
    enc = vitjax.Encoder.random(
        vitjax.VisionConfig(2, 144, 2, 80, 48, (0,)) if args.smoke else "qwen3-vl-8b",
        attention=args.attention,
        buckets=BucketPolicy(fit_granule=0),
    )
    engine = enc.parallel.engines[0]
    rng = np.random.default_rng(0)
    for name in args.workloads.split(","):
        count, res = WORKLOADS[name]
        grids, pixels, call = device_request(engine, rng, count, res)
        call()
        call()
        dispatch_ms, wall_ms = dispatch_and_wall(engine, pixels, grids)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10):
            engine.run(pixels, grids)
            jax.block_until_ready(engine.run(pixels, grids)[0].output)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        stats, _ = per_call(trace_events(call, CALLS, python=False), CALLS)
        events = trace_events(call, CALLS, python=True)
        traced, windows = per_call(events, CALLS)
        i = min(range(len(traced)), key=lambda j: traced[j]["wall_ms"])  # the quietest call
        marks = [e for e in events if re.fullmatch(r"call\d+", e["name"])]
        first = next((e["ts"] for e in windows[i] if e["gpu"]), marks[i]["ts"])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"host-events-{name}.json").write_text(json.dumps(windows[i]))
        emit(
            {
                "bench": "host",
                "workload": name,
                "attention": enc.attention,
                "dispatch_ms": dispatch_ms,
                "wall_ms": wall_ms,
                "calls": stats,
                "calls_python_traced": traced,
                "host_events": host_summary(windows[i], marks[i]["ts"], first),
                "cprofile_20_runs": text.getvalue()[-6000:],
            }
        )


if __name__ == "__main__":
    main()
