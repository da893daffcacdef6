"""How fa4's Hopper forward time follows the widths of its two products, on the tower's 20 x 4800 attention.

fa4 rounds head_dim 72 up to 80 inside the tile for both products: Q·Kᵀ contracts over 80 columns and P·V produces
80. The question before writing a kernel that runs P·V at 72: is the time proportional to the widths? Each pair
(head_dim, head_dim_v) is timed in rounds of rotating order under the same schedule (192 x 144, P through shared
memory: upstream's for every width up to 96), forward, bf16, 16 heads, back-to-back calls.

    PYTHONPATH=. python bench/bench_fa4_widths.py [--pairs 72:72,72:64,64:64,80:80] [--rounds 3]

One JSON object per line, also appended to bench/results/<device>-<date>.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import CASES, HEADS, pipelined_ms, recorder, rotating_rounds, run_fn, segments

from vitjax import fa4  # noqa: E402

TILE = "192x144ss"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", default="72:72,72:64,64:64,80:80", help="head_dim:head_dim_v, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    _, emit = recorder("bench_fa4_widths.py", args.out)
    grids, tokens, slots = CASES["20x4800"]
    seg = segments(grids, tokens, slots)
    pairs = [tuple(int(w) for w in p.split(":")) for p in args.pairs.split(",")]
    for d in {d for d, _ in pairs}:  # upstream picks 192 x 128 with P in registers at 64 and below
        fa4.set_fa4_tile(d, fa4.Fa4Tile.parse(TILE))
    rng = np.random.default_rng(0)
    inputs = {
        (d, dv): tuple(jnp.asarray(rng.standard_normal((tokens, HEADS, w)), jnp.bfloat16) for w in (d, d, dv))
        for d, dv in pairs
    }
    fn = run_fn("fa4", seg)  # q, k and v at whatever widths they have
    times: dict[tuple[int, int], list[float]] = {p: [] for p in pairs}
    for _, p in rotating_rounds(pairs, args.rounds):
        times[p].append(pipelined_ms(fn, *inputs[p]))
    scores = float(np.sum(np.asarray(seg.lengths, np.int64) ** 2)) * HEADS
    base = statistics.median(times[pairs[0]])
    for (d, dv), ms in times.items():
        med = statistics.median(ms)
        emit(
            {
                "workload": "20x4800",
                "head_dim": d,
                "head_dim_v": dv,
                "tile": TILE,
                "tile_widths": [-(-d // 16) * 16, -(-dv // 16) * 16],
                "ms_median": round(med, 4),
                "ms_rounds": [round(t, 4) for t in ms],
                "ratio_to_first": round(med / base, 4),
                "tflops": round(2 * scores * (d + dv) / med / 1e9, 1),
            }
        )


if __name__ == "__main__":
    main()
