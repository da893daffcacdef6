"""How the fixed-shift fa4 kernel's overflow check is put together in XLA, and what each form costs, 20 x 4800 at 72.

The fixed-shift schedule (`192x112rs3:vsum:fix`) poisons the rows whose scores outgrow their first block's maximum
(NaN log-sum-exp); the call must then run again with the online maximum. In the 20-photo tower the first form
(`lax.cond` passing the kernel's output through) cost a 252 MB device copy a block (`memcpy128`, 4.3 ms a call). The
forms, each alone and inside a 4-step `lax.scan` whose next q is the last output (as the tower's blocks chain):
- `kernel`: the fixed-shift kernel, unguarded; `kernel_lse`: the same with its log-sum-exp written; `check_only`:
  that and the reduction to one flag, no second call;
- `cond`: `lax.cond(overflowed, online, identity, out)`;
- `cond_dus`: the same with the online result written over the operand (`dynamic_update_slice`);
- `while`: a `while_loop` that runs the online call at most once, the output its carry;
- `online`: the online-maximum kernel (`192x112rs3:vsum`), the schedule before.
Rows carry the median ms and the number of copy instructions in the optimized program.

    PYTHONPATH=.:bench python bench/bench_fa4_guard.py [--rounds 5]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import CASES, case_segments, errors, pipelined_ms, random_qkv, rotating_rounds, run_cases

from vitjax import attention, fa4

HEAD_DIM = 72
FIX, ONLINE = fa4.Fa4Tile.parse("192x112rs3:vsum:fix"), fa4.Fa4Tile.parse("192x112rs3:vsum")


def forms(seg: attention.Segments) -> dict:
    from fa4_jax import flash_attn_varlen

    fa4._route_fa4_schedules()  # our schedules (`FA4_TILES`) for the calls made here directly
    cu, used = fa4.cu_seqlens(seg, seg.ids.shape[0]), seg.lengths
    call = functools.partial(flash_attn_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=used, seqused_k=used)
    columns = attention.value_columns("fa4", HEAD_DIM)

    def checked(q, k, v):
        out, lse = call(q, k, v, return_lse=True)
        return out, jnp.any(jnp.isnan(lse) & (seg.ids >= 0)[None])

    def online(q, k, v):
        return attention.widen(call(q, k, v[..., :HEAD_DIM]), columns)

    def cond(q, k, v):
        out, bad = checked(q, k, v)
        return jax.lax.cond(bad, lambda o: online(q, k, v), lambda o: o, out)

    def cond_dus(q, k, v):
        out, bad = checked(q, k, v)
        return jax.lax.cond(
            bad, lambda o: jax.lax.dynamic_update_slice(o, online(q, k, v), (0, 0, 0)), lambda o: o, out
        )

    def loop(q, k, v):
        out, bad = checked(q, k, v)
        return jax.lax.while_loop(lambda c: c[1], lambda c: (online(q, k, v), jnp.bool_(False)), (out, bad))[0]

    return {
        "kernel": lambda q, k, v: call(q, k, v),
        "kernel_lse": lambda q, k, v: checked(q, k, v)[0],
        "check_only": checked,
        "cond": cond,
        "cond_dus": cond_dus,
        "while": loop,
        "online": lambda q, k, v: call(q, k, v),
    }


def scanned(fn):
    """`fn` four times, each step's q the previous output's first 72 columns."""

    def run(q, k, v):
        def step(carry, _):
            q, flag = carry
            out = fn(q, k, v)
            if isinstance(out, tuple):  # `check_only`: the flag is kept, so its reduction runs
                out, flag = out[0], flag | out[1]
            return (out[..., :HEAD_DIM].astype(q.dtype), flag), None

        return jax.lax.scan(step, (q, jnp.bool_(False)), None, length=4)[0]

    return run


def main() -> None:
    for r in run_cases("bench_fa4_guard", run_case):
        if r["what"] == "time":
            print(f"{r['case']:<10}{r['variant']:<12}{r['form']:<7}{r['ms']:>8.3f} ms  copies {r['copies']}")


def run_case(case: str, rounds: int, emit) -> None:
    grids, tokens, slots = CASES[case]
    seg = case_segments(grids, tokens, slots)
    q, k, v = random_qkv(0, tokens, HEAD_DIM)
    v = attention.widen(v, attention.value_columns("fa4", HEAD_DIM))
    real = np.asarray(seg.ids) >= 0
    ref = np.asarray(attention.attention(q, k, v[..., :HEAD_DIM], seg, "reference"), np.float32)
    shipped = fa4.FA4_TILES.get(HEAD_DIM)
    fns = {}
    try:
        for name, fn in forms(seg).items():
            fa4.set_fa4_tile(HEAD_DIM, ONLINE if name == "online" else FIX)
            for kind, f in (("alone", fn), ("scan4", scanned(fn))):
                exe = jax.jit(f).lower(q, k, v).compile()
                copies = sum(" copy(" in line or "copy-start" in line for line in exe.as_text().splitlines())
                fns[(name, kind)] = (exe, copies)
            got = fns[(name, "alone")][0](q, k, v)
            got = got[0] if isinstance(got, tuple) else got
            emit({"case": case, "what": "check", "variant": name, **errors(got, ref, real)})
    finally:
        fa4.set_fa4_tile(HEAD_DIM, shipped)
    times: dict = {key: [] for key in fns}
    for _, key in rotating_rounds(list(fns), rounds):
        times[key].append(pipelined_ms(fns[key][0], q, k, v))
    for (name, kind), ms in times.items():
        emit(
            {
                "case": case,
                "what": "time",
                "variant": name,
                "form": kind,
                "ms": float(np.median(ms)),
                "ms_rounds": ms,
                "copies": fns[(name, kind)][1],
            }
        )


if __name__ == "__main__":
    main()
