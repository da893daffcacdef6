"""fa4's kernel on token-major q/k/v (as the tower calls it) against head-major ones, the kernel alone.

Token-major `[T, 16, 72]` (what the qkv GEMM writes) gives each key row of one head 144 bytes that touch five 32-byte
sectors (160 B); head-major `[16, T, 72]`, given to fa4 as one sequence per frame and head (`[16·T, 1, 72]`), makes a
K/V tile one contiguous run of whole sectors: 10% fewer L2 bytes for the stream every thread block reads. A layout
change pays only if the kernel gains more than what producing and consuming head-major costs, so both are timed: the
kernel on inputs already head-major, and the transposes a tower would add (q, k, v in and the output back, here as
XLA copies). 20 × 4800 and 1 × 3520, 16 heads, forward, bf16, rotating rounds, and each output checked against
token-major fa4's.

    PYTHONPATH=. python bench/bench_fa4_layout.py [--rounds 5]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import CASES, HEADS, case_segments, pipelined_ms, random_qkv, rotating_rounds, run_cases

from vitjax import attention, fa4


def head_major_segments(seg: attention.Segments, tokens: int) -> tuple[jax.Array, jax.Array]:
    """cu_seqlens and used lengths of every (head, slot) as its own sequence over `[16·T, 1, D]`."""
    cu = fa4.cu_seqlens(seg, tokens)
    starts = (jnp.arange(HEADS, dtype=jnp.int32)[:, None] * tokens + cu[None, :-1]).ravel()
    cu_heads = jnp.concatenate([starts, jnp.full((1,), HEADS * tokens, jnp.int32)])
    return cu_heads, jnp.tile(seg.lengths.astype(jnp.int32), HEADS)


def to_heads(x: jax.Array) -> jax.Array:
    """[T, H, D] -> [H·T, 1, D]."""
    return jnp.transpose(x, (1, 0, 2)).reshape(-1, 1, x.shape[-1])


def from_heads(x: jax.Array) -> jax.Array:
    """[H·T, 1, D] -> [T, H, D]."""
    return jnp.transpose(x.reshape(HEADS, -1, x.shape[-1]), (1, 0, 2))


def run_case(case: str, rounds: int, emit) -> None:
    from fa4_jax import flash_attn_varlen

    grids, tokens, slots = CASES[case]
    seg = case_segments(grids, tokens, slots)
    q, k, v = random_qkv(0, tokens, 72)
    cu_heads, used_heads = head_major_segments(seg, tokens)
    fns = {
        "token_major": jax.jit(lambda q, k, v: attention.attention(q, k, v, seg, "fa4")),
        "head_major_kernel": jax.jit(
            lambda q, k, v: flash_attn_varlen(q, k, v, cu_heads, cu_heads, seqused_q=used_heads, seqused_k=used_heads)
        ),
        "transposes_in": jax.jit(lambda q, k, v: tuple(to_heads(x) for x in (q, k, v))),
        "transpose_out": jax.jit(from_heads),
    }
    qh, kh, vh = fns["transposes_in"](q, k, v)
    inputs = {
        "token_major": (q, k, v),
        "head_major_kernel": (qh, kh, vh),
        "transposes_in": (q, k, v),
        "transpose_out": (qh,),
    }
    real = np.asarray(seg.ids) >= 0
    want = np.asarray(fns["token_major"](q, k, v), np.float32)[real]
    got = np.asarray(fns["transpose_out"](fns["head_major_kernel"](qh, kh, vh)), np.float32)[real]
    emit({"case": case, "what": "check", "max_abs_diff": float(np.abs(got - want).max())})
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _, name in rotating_rounds(list(fns), rounds):
        times[name].append(pipelined_ms(fns[name], *inputs[name]))
    flop = 4 * 72 * HEADS * sum((t * h * w) ** 2 for t, h, w in grids)
    for name, ms in times.items():
        median = float(np.median(ms))
        row = {"case": case, "what": name, "ms": median, "ms_rounds": ms}
        if name in ("token_major", "head_major_kernel"):
            row["tflops"] = flop / median / 1e9
        emit(row)


def main() -> None:
    run_cases("bench_fa4_layout", run_case)


if __name__ == "__main__":
    main()
