"""Where `Encoder.encode`'s time goes, JPEG bytes to embeddings: the 20 photos of `bench_encode.py` (8B tower, random
bf16 weights, the machine's attention, cache off, PIL decoder) on N devices, with every host step of the request on
one clock (ms from the call's start): each input's prepare (decode, hash) and rows in the pipeline's workers, when the
encode's loop took each prepared input, each tower call's `Batch.finish` (waiting for its rows) and `encode_patches`
in the dispatch thread, and when each call's outputs were ready on the device. Beside it, the same calls' rows
given to `encode_patches` from the host with nothing else running (`tower_only`; on one device also from rows already
on it, `tower_only_device_rows`). Median of `--reps` requests; the
timeline is the median request's; with `--workers`, one timeline for each count of preprocessing threads, in turn.

    PYTHONPATH=.:bench python bench/encode_timeline.py --devices 1 --out bench/results
"""

from __future__ import annotations

import argparse
import functools
import threading
import time

import jax
import numpy as np
from bench_attention import recorder  # bench/ is on sys.path when run as a script
from bench_encode import jpegs, settled

import vitjax
import vitjax.encoder
from vitjax import pipeline
from vitjax.settings import BATCH_TOKENS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--batch-tokens", type=int, help="patches per call per device (default: encode's own)")
    ap.add_argument(
        "--workers", help="comma-separated preprocessing thread counts, repeats allowed (default: the pipeline's)"
    )
    args = ap.parse_args()
    _, emit = recorder("encode_timeline", args.out)
    enc = vitjax.Encoder.random("qwen3-vl-8b", devices=args.devices, cache_bytes=0)
    data = jpegs(args.images)
    events: list[tuple[str, str, float, float]] = []  # (what, which, start, end), seconds from t0
    t0 = [0.0]
    lock = threading.Lock()
    waiters: list[threading.Thread] = []  # threads noting when a call's outputs are ready

    def note(what: str, which: str, start: float, end: float) -> None:
        with lock:
            events.append((what, which, start - t0[0], end - t0[0]))

    def timed(owner, name: str, label, wait_outputs: bool = False) -> None:
        original = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            out = original(*a, **k)
            end = time.perf_counter()
            note(name, label(*a), start, end)
            if wait_outputs:  # when the call's outputs are ready on the device, from a thread that waits on them
                which = label(*a)

                def wait(out=out, which=which):
                    jax.block_until_ready(out)
                    note("outputs_ready", which, end, time.perf_counter())

                waiters.append(threading.Thread(target=wait))
                waiters[-1].start()
            return out

        setattr(owner, name, wrapper)

    timed(pipeline.PilDecoder, "prepare", lambda self, name, source: name)
    timed(pipeline, "_fill_rows", lambda item, rows: item.name)
    timed(pipeline.Batch, "finish", lambda self: f"{len(self.items)} inputs, {self.rows} rows")
    timed(vitjax.Encoder, "encode_patches", lambda self, pixels, grids, **k: f"{len(grids)} inputs", True)
    taken = pipeline.Pipeline.prepare

    def prepare(self, items):
        for item in taken(self, items):
            now = time.perf_counter()
            note("taken", getattr(item, "name", "error"), now, now)
            yield item

    pipeline.Pipeline.prepare = prepare

    def request(workers: int | None = None):
        out = enc.encode(data, batch_tokens=args.batch_tokens, workers=workers)
        jax.block_until_ready([o.features for o in out])
        while waiters:  # each has noted its call before the next request's events begin
            waiters.pop().join()

    calls = []
    for workers in [int(w) for w in args.workers.split(",")] if args.workers else [None]:
        calls = timeline_of(functools.partial(request, workers), enc, events, t0, args, emit, workers)
    # The same calls' rows from the host with nothing else running: what the tower takes for them.
    sizes = [int(c[0].split()[0]) for c in calls if "rows" not in c[0]]
    grid = (1, 60, 80)  # a 960x1280 photo's patches: every input of this workload
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, (n * 4800, 1536), np.uint8) for n in sizes]

    def tower_only(calls):
        outs = [enc.encode_patches(p, np.array([grid] * (len(p) // 4800)), levels=True) for p in calls]
        jax.block_until_ready(outs)

    rows = {"host": pixels, "device": [jax.device_put(p, enc.parallel.engines[0].devices[0]) for p in pixels]}
    for where in ("host", "device") if args.devices == 1 else ("host",):
        for _ in range(3):
            tower_only(rows[where])
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            tower_only(rows[where])
            times.append((time.perf_counter() - start) * 1e3)
        label = "tower_only" if where == "host" else "tower_only_device_rows"
        emit({"devices": args.devices, "label": label, "calls": sizes, "ms": float(np.median(times)), "ms_all": times})
        print(f"{label}, calls of {sizes} inputs: {np.median(times):.1f} ms")


def timeline_of(request, enc, events, t0, args, emit, workers: int | None) -> list[tuple]:
    """`--reps` requests after settling ones; the median request's timeline emitted, its calls returned."""
    settled(request, enc)
    runs = []
    for _ in range(args.reps):
        events.clear()
        t0[0] = time.perf_counter()
        request()
        total = time.perf_counter() - t0[0]
        runs.append((total, sorted(events, key=lambda e: e[2])))
    runs.sort(key=lambda r: r[0])
    total, timeline = runs[len(runs) // 2]
    ms = [round(r[0] * 1e3, 2) for r in runs]

    def span(what: str) -> list[float]:
        hits = [e for e in timeline if e[0] == what]
        return [round(min(e[2] for e in hits) * 1e3, 2), round(max(e[3] for e in hits) * 1e3, 2)] if hits else []

    calls = [
        (e[1], round(e[2] * 1e3, 2), round(e[3] * 1e3, 2)) for e in timeline if e[0] in ("finish", "encode_patches")
    ]
    ready = [(e[1], round(e[3] * 1e3, 2)) for e in timeline if e[0] == "outputs_ready"]
    emit(
        {
            "devices": args.devices,
            "images": args.images,
            "workers": workers or pipeline.default_workers(),
            "batch_tokens": args.batch_tokens or BATCH_TOKENS,
            "attention": enc.attention,
            "label": "encode",
            "ms": total * 1e3,
            "ms_all": ms,
            "prepare_span_ms": span("prepare"),
            "rows_span_ms": span("_fill_rows"),
            "taken_span_ms": span("taken"),
            "calls": calls,
            "outputs_ready": ready,
            "events": [(w, n, round(a * 1e3, 2), round(b * 1e3, 2)) for w, n, a, b in timeline],
        }
    )
    spans = f"prepare {span('prepare')}, rows {span('_fill_rows')}"
    print(f"{workers or 'default'} workers: encode {total * 1e3:.1f} ms (all {ms}); {spans}")
    for c in calls:
        print("  ", c)
    for r in ready:
        print("   ready", r)
    return calls


if __name__ == "__main__":
    main()
