"""FP8 attention at head_dim 72 (issue 12's opt-in): cuDNN's FP8 flash attention beside fa4 and cuDNN in bf16.

The one FP8 flash attention JAX reaches (`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(...,
use_fp8=True)`; fa4's Hopper forward takes fp16/bf16 only) takes no segment offsets, lengths or masks, and a head
dim that is a multiple of 16. So it can run only calls whose frames all have one size, as a batch `[B, L, heads,
80]`: q, k, v cut to the used rows, zero-padded from 72 to 80 and cast to float8_e4m3fn, the output (float8 too)
cast back. `cudnn_fp8` times all of that from the bf16 packed rows the tower has; `cudnn_fp8_kernel` the kernel alone
on inputs already in FP8 (the bound if the casts were free). P is scaled by 448 before its FP8 rounding (e4m3's
largest value), q, k, v and O are not scaled (unit-variance inputs; e4m3's relative step is the same at any scale).
Errors against the fp32 reference as in `bench_attention.py`.

    PYTHONPATH=. python bench/bench_fp8.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import (  # noqa: E402
    CASES,
    HEADS,
    case_segments,
    errors,
    pipelined_ms,
    random_qkv,
    recorder,
    reference,
    rotating_rounds,
    run_fn,
)
from jax._src.cudnn.fused_attention_stablehlo import (  # noqa: E402
    MaskType,
    dot_product_attention,
    fp8_params_keys,
)

HEAD_DIM, WIDTH = 72, 80  # the model's head dim; FP8 needs a multiple of 16
FP8 = jnp.float8_e4m3fn
P_SCALE = 448.0
EQUAL_FRAMES = ("20x4800", "1x3520", "60x480", "120x480")


def fp8_params() -> dict:
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    params = dict.fromkeys(fp8_params_keys, one)
    params["scale_s"], params["descale_s"] = one * P_SCALE, one / P_SCALE
    return params


def to_batch(x: jax.Array, frames: int, length: int) -> jax.Array:
    """Packed bf16 rows [T, heads, 72] -> [frames, length, heads, 80] in FP8."""
    x = x[: frames * length].reshape(frames, length, HEADS, HEAD_DIM)
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, WIDTH - HEAD_DIM))).astype(FP8)


def fp8_kernel(q, k, v, params):
    out, _, _ = dot_product_attention(
        q, k, v, fp8_params=params, scale=HEAD_DIM**-0.5, mask_type=MaskType.NO_MASK, qkv_layout="BTNH", use_fp8=True
    )
    return out


def fp8_from_rows(frames: int, length: int, tokens: int):
    """The whole FP8 path from the tower's packed bf16 rows back to them."""

    def run(q, k, v, params):
        out = fp8_kernel(*(to_batch(x, frames, length) for x in (q, k, v)), params)
        out = out[..., :HEAD_DIM].astype(jnp.bfloat16).reshape(frames * length, HEADS, HEAD_DIM)
        return jnp.pad(out, ((0, tokens - frames * length), (0, 0), (0, 0)))

    return jax.jit(run)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rows, emit = recorder("bench_fp8", args.out)
    params = fp8_params()
    for case in EQUAL_FRAMES:
        grids, tokens, slots = CASES[case]
        frames, length = len(grids), grids[0][1] * grids[0][2]
        seg = case_segments(grids, tokens, slots)
        real = np.asarray(seg.ids) >= 0
        q, k, v = random_qkv(0, tokens, HEAD_DIM)
        ref = reference(seg, q, k, v)
        batch = [to_batch(x, frames, length) for x in (q, k, v)]
        kernel = jax.jit(fp8_kernel)
        runs = {
            "fa4": (run_fn("fa4", seg), (q, k, v)),
            "cudnn_packed": (run_fn("cudnn_packed", seg), (q, k, v)),
            "cudnn_fp8": (fp8_from_rows(frames, length, tokens), (q, k, v, params)),
            "cudnn_fp8_kernel": (kernel, (*batch, params)),
        }
        flop = 4 * HEADS * HEAD_DIM * frames * length**2
        for name, (fn, fn_args) in runs.items():
            out = fn(*fn_args)
            if name == "cudnn_fp8_kernel":
                out = out[..., :HEAD_DIM].astype(jnp.float32).reshape(frames * length, HEADS, HEAD_DIM)
                out = jnp.pad(out, ((0, tokens - frames * length), (0, 0), (0, 0)))
            own = reference(seg, q, k, v, fn) if name == "fa4" else ref  # fa4's q as the path was given it
            emit({"bench": "fp8_check", "frames": case, "impl": name, **errors(out, own, real)})
        for round_, name in rotating_rounds(list(runs), args.rounds):
            fn, fn_args = runs[name]
            ms = pipelined_ms(fn, *fn_args)
            emit(
                {
                    "bench": "fp8_speed",
                    "frames": case,
                    "impl": name,
                    "round": round_,
                    "ms_pipelined": ms,
                    "tflops_pipelined": flop / ms / 1e9,
                }
            )
    print(f"{'frames':<10}{'impl':>18}{'ms (median)':>13}{'TF/s':>7}{'rel l2 err':>12}{'max abs err':>12}")
    for case in EQUAL_FRAMES:
        for name in ("fa4", "cudnn_packed", "cudnn_fp8", "cudnn_fp8_kernel"):
            times = [r for r in rows if r["bench"] == "fp8_speed" and r["frames"] == case and r["impl"] == name]
            check = next(r for r in rows if r["bench"] == "fp8_check" and r["frames"] == case and r["impl"] == name)
            ms = float(np.median([r["ms_pipelined"] for r in times]))
            tf = float(np.median([r["tflops_pipelined"] for r in times]))
            print(f"{case:<10}{name:>18}{ms:>13.3f}{tf:>7.0f}{check['rel_l2_err']:>12.4f}{check['max_abs_err']:>12.4f}")


if __name__ == "__main__":
    main()
