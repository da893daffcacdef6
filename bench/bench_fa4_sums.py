"""fa4 at head_dim 72 with V at the tile's width 80, and with the softmax's row sums carried by P·V, the kernel alone.

Inside fa4's tile head_dim 72 runs as 80. With V's column 72 all ones, column 72 of P·V is each row's softmax sum
(`vitjax.fa4_sums`): the tensor cores keep the sums and the softmax stops adding them. The variants, timed in
rotating rounds on the tower's attention workloads (`bench_attention.CASES`), forward, bf16, 16 heads:
- `narrow`: q, k, v at 72 (the tower's call before V was widened);
- `v80`: V at 80 with zero columns, fa4's own softmax (`192x112rs3`): what a wider V and output cost or save alone;
- `vsum`: V at 80 with the ones column (`attention.value_columns`), row sums by the tensor cores (`192x112rs3:vsum`,
  the shipped schedule);
- `cudnn_packed`.
Each is checked against the fp32 reference (its first 72 output columns) on the timed workload and on odd frames with
unused slots and padding (NaN in the padding rows); `vsum` is also run with V's column 72 left zero, where it must be
far off (the check that its kernel is the one that ran).

    PYTHONPATH=.:bench python bench/bench_fa4_sums.py [--rounds 5] [--cases 20x4800,20xmixed,1x3520]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import CASES, case_segments, errors, pipelined_ms, random_qkv, recorder, rotating_rounds

from vitjax import attention, fa4

HEAD_DIM = 72
CHECK_GRIDS = ([(1, 38, 54), (2, 20, 26), (1, 2, 2), (1, 46, 30)], 6144, 8)  # 4,476 tokens
# variant: (fa4 schedule, V widened); the others are `attention` paths
FA4 = {
    "narrow": ("192x112rs3", False),
    "v80": ("192x112rs3", True),
    "vsum": ("192x112rs3:vsum", True),
}
SUMS = attention.value_columns("fa4", HEAD_DIM)  # V's appended columns under the shipped (value_sums) schedule


def inputs(name: str, q, k, v, ones: bool = True) -> tuple:
    """A variant's q, k, v (`ones=False`: V widened with zeros only)."""
    if name not in FA4 or not FA4[name][1]:
        return q, k, v
    return q, k, attention.widen(v, SUMS if ones and name == "vsum" else (0.0,) * len(SUMS))


def compiled(name: str, seg: attention.Segments, args: tuple):
    """One variant's call, compiled now: the fa4 schedule is read when the program is traced."""
    impl = "fa4" if name in FA4 else name
    if name in FA4:
        fa4.set_fa4_tile(HEAD_DIM, fa4.Fa4Tile.parse(FA4[name][0]))
    return jax.jit(lambda q, k, v: attention.attention(q, k, v, seg, impl)).lower(*args).compile()


def check(names: list[str], grids, tokens: int, slots: int, emit, case: str) -> dict:
    """Each variant compiled for the case, and its errors against the fp32 reference on the real rows (`errors` reads
    the first 72 output columns)."""
    seg = case_segments(grids, tokens, slots)
    q, k, v = random_qkv(1, tokens, HEAD_DIM)
    if case == "odd":  # NaN in the padding rows must not reach a real row
        pad = np.asarray(seg.ids) < 0
        q, k, v = (jnp.where(pad[:, None, None], jnp.nan, x) for x in (q, k, v))
    real = np.asarray(seg.ids) >= 0
    ref = np.asarray(attention.attention(q, k, v, seg, "reference"), np.float32)
    fns = {name: compiled(name, seg, inputs(name, q, k, v)) for name in names}
    for name in names:
        got = fns[name](*inputs(name, q, k, v))
        emit({"case": case, "what": "check", "variant": name, **errors(got, ref, real)})
    if "vsum" in names:  # V's column 72 zero: the sums are 0, O is left undivided, far from the reference
        got = fns["vsum"](*inputs("vsum", q, k, v, ones=False))
        emit({"case": case, "what": "check", "variant": "vsum_without_ones", **errors(got, ref, real)})
    return fns


def run_case(case: str, names: list[str], rounds: int, emit) -> None:
    grids, tokens, slots = CASES[case]
    fns = check(names, grids, tokens, slots, emit, case)
    q, k, v = random_qkv(0, tokens, HEAD_DIM)
    args = {name: inputs(name, q, k, v) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for _, name in rotating_rounds(names, rounds):
        times[name].append(pipelined_ms(fns[name], *args[name]))
    flop = 4 * HEAD_DIM * 16 * sum((t * h * w) ** 2 for t, h, w in grids)
    for name, ms in times.items():
        median = float(np.median(ms))
        row = {"case": case, "what": "time", "variant": name, "ms": median, "ms_rounds": ms}
        emit({**row, "tflops": flop / median / 1e9})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default="20x4800,20xmixed,1x3520")
    ap.add_argument("--variants", default="narrow,v80,vsum,cudnn_packed")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    names = args.variants.split(",")
    rows, emit = recorder("bench_fa4_sums", args.out)
    shipped = fa4.FA4_TILES.get(HEAD_DIM)
    try:
        check(names, *CHECK_GRIDS, emit, "odd")
        for case in args.cases.split(","):
            run_case(case, names, args.rounds, emit)
    finally:
        fa4.set_fa4_tile(HEAD_DIM, shipped)
    for r in rows:
        if r["what"] == "time":
            print(f"{r['case']:<10}{r['variant']:<14}{r['ms']:>8.3f} ms{r['tflops']:>6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
