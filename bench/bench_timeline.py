"""Where a tower call leaves the GPU idle: the device ops of device-only calls in time order (one GPU).

`bench_vit.py` puts the 1 x 720p call at ~14 ms device-only against ~11 ms of device work, and the 20-photo one
~3 ms above its work. Here the 8B tower (random bf16 weights) runs device-resident pixels under JAX's profiler;
per workload: the host's dispatch time (until `Engine.run` returns), the span from the first device op to the
last, the busy time (the union of all ops), and the idle time between ops grouped by the ops on either side
(names without XLA's numeric suffixes), largest first. Each workload runs in three modes, alternating, twice:
`before` (every call's layout copied to the device anew, `LAYOUT_CACHE = 0`, and pixel chunk views through the
public `jax.dlpack.from_dlpack`), `layouts_kept` (the layout cache alone) and `shipped`. One JSON object per line.

    PYTHONPATH=. python bench/bench_timeline.py --out bench/results
"""

from __future__ import annotations

import argparse
import collections
import re
import time

import jax
import numpy as np
from bench_attention import recorder  # bench/ is on sys.path when run as a script
from bench_vit import RESOLUTIONS, device_events

import vitjax
from vitjax import row_views

WORKLOADS = {"1x720p": (1, "720p"), "20x960x1280": (20, "960x1280")}
KEPT = vitjax.engine.LAYOUT_CACHE
MODES = {"before": (0, False), "layouts_kept": (KEPT, False), "shipped": (KEPT, True)}
CALLS = 3
MIN_GAP_US = 5.0


def short(op: str) -> str:
    """An op's kind: XLA's numbered names merged (fusion_12 -> fusion), long kernel names cut."""
    return re.sub(r"(_\d+)+$", "", op)[:48]


def timeline(events: list[tuple[str, str, float, float]]) -> dict:
    """Span, busy time and idle gaps (grouped by the ops around them) of `CALLS` calls' device ops, per call."""
    span = (max(ts + dur for _, _, ts, dur in events) - events[0][2]) / CALLS
    busy, gaps = 0.0, collections.defaultdict(lambda: [0, 0.0])
    end, before = events[0][2], events[0][1]
    for _, op, ts, dur in events:
        if ts > end:
            gap = ts - end
            if gap >= MIN_GAP_US:
                key = f"{short(before)} -> {short(op)}"
                gaps[key][0] += 1
                gaps[key][1] += gap
        busy += max(0.0, ts + dur - max(ts, end))
        if ts + dur > end:
            end, before = ts + dur, op
    top = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "span_ms": span / 1e3,
        "busy_ms": busy / CALLS / 1e3,
        "gaps": [{"between": k, "count": n / CALLS, "ms": us / CALLS / 1e3} for k, (n, us) in top],
    }


def device_request(engine: vitjax.engine.Engine, rng: np.random.Generator, count: int, res: str) -> tuple:
    """(grids, pixels, call): `count` frames of resolution `res` as random pixel rows on the device, and a call of
    the engine on them that waits for its outputs."""
    grids = [RESOLUTIONS[res]] * count
    rows = sum(t * h * w for t, h, w in grids)
    pixels = jax.device_put(rng.standard_normal((rows, engine.cfg.patch_dim), np.float32))

    def call():
        return jax.block_until_ready([c.output for c in engine.run(pixels, grids)])

    return grids, pixels, call


def dispatch_and_wall(engine: vitjax.engine.Engine, pixels: jax.Array, grids: list) -> tuple[float, float]:
    """Medians (ms) of the host's dispatch (`Engine.run` until it returns) and of the wall time until the outputs are
    ready, over 20 calls (10 for calls of 10,000 rows or more)."""
    dispatch, wall = [], []
    for _ in range(20 if len(pixels) < 10_000 else 10):
        start = time.perf_counter()
        outputs = [c.output for c in engine.run(pixels, grids)]
        dispatch.append(time.perf_counter() - start)
        jax.block_until_ready(outputs)
        wall.append(time.perf_counter() - start)
        del outputs
    return float(np.median(dispatch)) * 1e3, float(np.median(wall)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", default=None, help="the tower's attention path (default: the automatic one)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    _, emit = recorder("bench_timeline", args.out)
    enc = vitjax.Encoder.random("qwen3-vl-8b", attention=args.attention)
    engine = enc.parallel.engines[0]
    rng = np.random.default_rng(0)
    private_views = row_views._import_rows
    for (name, (count, res)), mode in ((w, m) for w in WORKLOADS.items() for m in [*MODES] * 2):
        cache, private = MODES[mode]
        vitjax.engine.LAYOUT_CACHE = cache
        row_views._import_rows = private_views if private else lambda *_: None
        grids, pixels, call = device_request(engine, rng, count, res)
        call()
        dispatch_ms, wall_ms = dispatch_and_wall(engine, pixels, grids)
        emit(
            {
                "bench": "timeline",
                "workload": name,
                "attention": enc.attention,
                "mode": mode,
                "dispatch_ms": dispatch_ms,
                "wall_ms": wall_ms,
                **timeline(device_events(call, CALLS)),
            }
        )


if __name__ == "__main__":
    main()
