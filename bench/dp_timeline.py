"""Where a data-parallel request's time goes: the 20 photos (8B tower, random bf16 weights, fa4, host pixels in
float32) on N engines, each engine's host steps (`Engine._inputs`, `Engine.run`; ms from the request's start) and
when each device's outputs are ready, against one engine's share alone (from host pixels, and from pixels already on
its device) and all engines called one after the other from one thread (pixels on their devices, or from the host).
Median of `--reps` requests; `last` is the last one's timeline.

    PYTHONPATH=.:bench python bench/dp_timeline.py --devices 4 --out bench/results
"""

from __future__ import annotations

import argparse
import threading
import time

import jax
import numpy as np
from bench_attention import recorder  # bench/ is on sys.path when run as a script

import vitjax

PHOTO = (1, 60, 80)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    _, emit = recorder("dp_timeline", args.out)
    enc = vitjax.Encoder.random("qwen3-vl-8b", devices=args.devices, attention="fa4")
    grids = [PHOTO] * args.images
    rows = args.images * 4800
    pixels = np.random.default_rng(0).standard_normal((rows, 1536), np.float32)
    share = args.images // args.devices
    engines = enc.parallel.engines
    events: list[tuple] = []
    t0 = [0.0]

    def wrap(name):
        original = getattr(vitjax.engine.Engine, name)

        def timed(self, *a, **k):
            start = time.perf_counter()
            out = original(self, *a, **k)
            events.append((engines.index(self), name, start - t0[0], time.perf_counter() - t0[0]))
            return out

        setattr(vitjax.engine.Engine, name, timed)

    for name in ("_inputs", "run", "_layout"):
        wrap(name)

    def ready_times(outs) -> dict:
        """Each device's outputs' ready time, from threads that wait on them."""
        by_device: dict = {}
        for o in outs:
            by_device.setdefault(next(iter(o.devices())), []).append(o)
        done = {}

        def wait(d, arrays):
            jax.block_until_ready(arrays)
            done[str(d)] = time.perf_counter() - t0[0]

        threads = [threading.Thread(target=wait, args=item) for item in by_device.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return done

    def measure(label, fn):
        for _ in range(3):  # compiles, fitted buckets settle
            jax.block_until_ready(fn())
            for e in engines:
                e.settle()
        times, timeline = [], None
        for _ in range(args.reps):
            events.clear()
            t0[0] = time.perf_counter()
            outs = fn()
            dispatched = time.perf_counter() - t0[0]
            ready = ready_times(outs)
            times.append(max(ready.values()) * 1e3)
            timeline = {
                "dispatched_ms": dispatched * 1e3,
                "ready_ms": {k: v * 1e3 for k, v in ready.items()},
                "events": [(i, n, round(a * 1e3, 2), round(b * 1e3, 2)) for i, n, a, b in events],
            }
        emit(
            {
                "devices": args.devices,
                "label": label,
                "ms": float(np.median(times)),
                "ms_all": [round(t, 2) for t in times],
                "last": timeline,
            }
        )

    share_grids = [PHOTO] * share
    on_devices = [
        jax.device_put(pixels[i * share * 4800 : (i + 1) * share * 4800], e.devices[0]) for i, e in enumerate(engines)
    ]
    measure("dp_host", lambda: enc.encode_patches(pixels, np.array(grids)))
    measure("one_engine_host_share", lambda: engines[0].encode(pixels[: share * 4800], share_grids))
    measure("one_engine_device_share", lambda: engines[0].encode(on_devices[0], share_grids))
    measure(
        "all_engines_device_serial_dispatch",
        lambda: [o for e, p in zip(engines, on_devices, strict=True) for o in e.encode(p, share_grids)],
    )
    measure(
        "all_engines_host_serial_dispatch",
        lambda: [
            o
            for i, e in enumerate(engines)
            for o in e.encode(pixels[i * share * 4800 : (i + 1) * share * 4800], share_grids)
        ],
    )
    measure("dp_host_again", lambda: enc.encode_patches(pixels, np.array(grids)))


if __name__ == "__main__":
    main()
