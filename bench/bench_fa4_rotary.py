"""What q's rotary inside fa4's kernel (`vitjax.fa4_rotary`) costs the kernel, apart from XLA's passes: the kernel
alone on one GPU, in rounds of rotating order (`bench_attention.rotating_rounds`), forward, bf16, 16 heads, head_dim 72.

- `fa4`: the plain kernel on q and k rotated before (what the tower ran without the fusion);
- `rotating`: the shipped kernel, q read in place from q|k and rotated in shared memory;
- `strided`: the same kernel with the rotation taken out (q read in place, not rotated): the in-place read alone;
- `rotating:row0`: every row reads the position of token 0 (always cached): what reading the positions costs.

The last two give wrong outputs on purpose and are timed only; `rotating` is checked against `fa4` element by element.

    PYTHONPATH=. python bench/bench_fa4_rotary.py [--rounds 5]

One JSON object per line, also appended to bench/results/<device>-<date>.jsonl.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import CASES, HEADS, case_segments, pipelined_ms, random_qkv, recorder, rotating_rounds

from vitjax import attention, fa4_rotary, layout
from vitjax.rotary import apply_rotary, rotary

HEAD_DIM = 72


@dataclasses.dataclass(frozen=True)
class _Row0(fa4_rotary._RotateQTile):
    def token(self, seqlen, m_block, row):
        return 0


@dataclasses.dataclass(frozen=True)
class _NoRotation(fa4_rotary._RotateQTile):
    def get_n_block_min_max(self, *args, **kwargs):
        return self.block_info.get_n_block_min_max(*args, **kwargs)

    def consumer_wait_w_index_phase(self, *args, **kwargs):
        self.pipeline_q.consumer_wait_w_index_phase(*args, **kwargs)


def kernel_with(rotation) -> fa4_rotary.RotatingQForwardSm90:
    """The shipped kernel object with another rotation: a new object, so a new compiled kernel."""
    shipped = attention._fa4_sm90_forward(attention.FA4_TILES[HEAD_DIM], fa4_rotary.DTYPES["bfloat16"], 72, 1, 1, 1)
    kernel = copy.copy(shipped)
    kernel.rotation = rotation
    return kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rows, emit = recorder("bench_fa4_rotary", args.out)
    kernels = {"rotating": kernel_with(fa4_rotary._RotateQTile), "strided": kernel_with(_NoRotation)}
    kernels["rotating:row0"] = kernel_with(_Row0)
    for name in ("20x4800", "1x3520"):
        grids, tokens, slots = CASES[name]
        seg = case_segments(grids, tokens, slots)
        rope = rotary(jnp.asarray(layout.pack(grids, tokens, slots).rope_pos), HEAD_DIM, 10000.0)
        q, k, v = random_qkv(5, tokens, HEAD_DIM)
        qk = jnp.stack([q, k], axis=1)
        q_rot, k_rot = (jax.jit(apply_rotary)(x, rope.cos, rope.sin) for x in (q, k))
        cu = attention.cu_seqlens(seg, tokens)
        fns = {"fa4": (jax.jit(lambda q, k, v, seg=seg: attention.attention(q, k, v, seg, "fa4")), (q_rot, k_rot, v))}
        for variant, kernel in kernels.items():
            call = jax.jit(lambda *a, kernel=kernel: fa4_rotary.attention(kernel, *a))
            fns[variant] = (call, (qk, k_rot, v, cu, seg.lengths, (rope.positions, rope.cos_at, rope.sin_at)))
        real = np.asarray(seg.ids) >= 0
        plain, rotating = (np.asarray(fns[n][0](*fns[n][1]), np.float32)[real] for n in ("fa4", "rotating"))
        apart = np.abs(rotating - plain)
        emit({"check": "fa4_rotating_vs_plain", "frames": name, "differing": int((apart != 0).sum()),
              "elements": int(apart.size), "max_abs_apart": float(apart.max())})  # fmt: skip
        useful = sum(t * (h * w) ** 2 for t, h, w in grids)
        for rnd, variant in rotating_rounds(list(fns), args.rounds):
            fn, fn_args = fns[variant]
            ms = pipelined_ms(fn, *fn_args)
            row = {"bench": "fa4_rotary", "frames": name, "variant": variant, "round": rnd, "ms_pipelined": ms}
            emit({**row, "tflops_pipelined": round(4 * HEADS * HEAD_DIM * useful / ms / 1e9, 1)})
    medians = {}
    for r in rows:
        if r.get("bench") == "fa4_rotary":
            medians.setdefault((r["frames"], r["variant"]), []).append(r["ms_pipelined"])
    for (frames, variant), times in medians.items():
        print(f"{frames:<10}{variant:<16}{np.median(times):9.4f} ms (median of {len(times)})", flush=True)


if __name__ == "__main__":
    main()
