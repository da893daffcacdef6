"""Segment-masked attention on one GPU: correctness of the paths against each other, and their speed.

Times vitjax's `cudnn_packed` and `cudnn_padded` on ~100k-token packed sequences (20 frames of 4800
tokens, as 20 photos of 960x1280) for head_dim 72 (8B) and 64 (2B); the cost of unused segment slots
(bucket M larger than the frames present); and head_dim 72 zero-padded to 80/96/128 (cuDNN has native
kernels for some head dims). Prints one JSON object per measurement.

    PYTHONPATH=. python bench/bench_attention.py
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from vitjax import attention, layout

HEADS = 16


def segments(grids, tokens, slots, max_length=0) -> attention.Segments:
    packed = layout.pack(grids, tokens, slots)
    return attention.Segments(*(jnp.asarray(a) for a in packed[3:]), max_length=max_length)


def timed(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def pipelined_ms(fn, *args, reps: int = 50) -> float:
    """Mean ms over back-to-back calls: dispatch overlaps the GPU as inside a program, so a short kernel is not
    charged a host round trip each time (as `timed` charges it)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


def correctness() -> None:
    """Odd frame sizes, unused slots and tail padding: both cuDNN paths against the fp32 reference."""
    grids = [(1, 38, 54), (2, 20, 26), (1, 2, 2), (1, 46, 30)]
    tokens, slots = 6144, 8
    for dim in (72, 64):
        rng = np.random.default_rng(dim)
        q, k, v = (jnp.asarray(rng.standard_normal((tokens, HEADS, dim)), jnp.bfloat16) for _ in range(3))
        seg = segments(grids, tokens, slots, max_length=4096)
        real = np.asarray(seg.ids) >= 0
        ref = np.asarray(jax.jit(attention.attention, static_argnums=4)(q, k, v, seg, "reference"), np.float32)
        for impl in ("cudnn_packed", "cudnn_padded"):
            got = np.asarray(jax.jit(attention.attention, static_argnums=4)(q, k, v, seg, impl), np.float32)
            err = float(np.abs(got[real] - ref[real]).max())
            print(json.dumps({"check": "attention", "impl": impl, "head_dim": dim, "max_abs_err": err}), flush=True)


def speed() -> None:
    frames = [(1, 80, 60)] * 20  # 96,000 tokens
    mixed = [(1, 56, 64 + 2 * i) for i in range(20)]  # 3584 .. 5712 tokens per frame, 92,960
    tokens = 98304
    for name, grids in (("20x4800", frames), ("20xmixed", mixed)):
        useful = sum((h * w) ** 2 for _, h, w in grids)
        for dim in (72, 64):
            rng = np.random.default_rng(0)
            q, k, v = (jnp.asarray(rng.standard_normal((tokens, HEADS, dim)), jnp.bfloat16) for _ in range(3))
            for slots in (20, 32, 64, 256) if name == "20x4800" else (32,):
                for impl in ("cudnn_packed", "cudnn_padded"):
                    longest = max(h * w for _, h, w in grids)
                    seg = segments(grids, tokens, slots, max_length=-(-longest // 128) * 128)
                    fn = jax.jit(attention.attention, static_argnums=4)
                    t = timed(fn, q, k, v, seg, impl)
                    tflops = 4 * HEADS * dim * useful / t / 1e12
                    row = {"bench": "attention", "frames": name, "impl": impl, "head_dim": dim, "slots": slots}
                    print(json.dumps({**row, "ms": round(t * 1e3, 3), "tflops": round(tflops, 1)}), flush=True)
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal((tokens, HEADS, 72)), jnp.bfloat16) for _ in range(3))
        seg = segments(grids, tokens, 32)
        for padded_dim in (80, 96, 128):

            def padded(q, k, v, seg, padded_dim=padded_dim):
                pad = ((0, 0), (0, 0), (0, padded_dim - 72))
                qp, kp, vp = (jnp.pad(x, pad) for x in (q * (padded_dim / 72) ** 0.5, k, v))
                return attention.attention(qp, kp, vp, seg, "cudnn_packed")[..., :72]

            t = timed(jax.jit(padded), q, k, v, seg)
            tflops = 4 * HEADS * 72 * useful / t / 1e12
            row = {"bench": "attention", "frames": name, "impl": f"cudnn_packed_pad{padded_dim}", "head_dim": 72}
            print(json.dumps({**row, "slots": 32, "ms": round(t * 1e3, 3), "tflops": round(tflops, 1)}), flush=True)


if __name__ == "__main__":
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    correctness()
    speed()
