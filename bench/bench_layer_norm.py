"""The one-pass LayerNorm kernel (`vitjax.layer_norm`) under other launch shapes (one GPU).

The kernel holds a few rows in registers between their statistics and their output; in a 20-photo call its two
LayerNorms a block move ~24 GB in 7.7 ms (~3.1 TB/s), below the ~4 TB/s the rotary fusions reach. Here the same
kernel body runs at the 8B tower's width (1152) on the 20-photo bucket (98,304 rows) and the 720p one (3,584) with 4
to 32 rows a program and 4 or 8 warps (the Triton lowering; shipped: 4 rows, 4 warps), beside XLA's two-pass
LayerNorm; each checked against XLA's, timed back to back (median of rotating rounds). One JSON object
per line.

    PYTHONPATH=. python bench/bench_layer_norm.py --out bench/results
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import pipelined_ms, recorder, rotating_rounds  # bench/ is on sys.path when run as a script
from flax import nnx

from vitjax.layer_norm import one_pass
from vitjax.model import _LayerNorm

WIDTH = 1152
SHAPES = {"20x960x1280": 98304, "1x720p": 3584}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    _, emit = recorder("bench_layer_norm", args.out)
    norm = _LayerNorm(WIDTH, jnp.bfloat16, nnx.Rngs(0))
    scale = jax.random.normal(jax.random.key(1), (WIDTH,)).astype(jnp.bfloat16)
    bias = jax.random.normal(jax.random.key(2), (WIDTH,)).astype(jnp.bfloat16)
    norm.scale[...], norm.bias[...] = scale, bias
    variants = {"xla": None}
    for rows in (4, 8, 16, 32):
        for warps in (4, 8):
            variants[f"triton_r{rows}_w{warps}"] = (rows, warps)
    for shape, tokens in SHAPES.items():
        x = (jax.random.normal(jax.random.key(3), (tokens, WIDTH)) * 3 + 1).astype(jnp.bfloat16)
        reference = np.asarray(jax.jit(norm.xla)(x), np.float32)
        built = {}
        for name, spec in variants.items():
            fn = (
                norm.xla
                if spec is None
                else functools.partial(one_pass, scale=scale, bias=bias, eps=1e-6, rows=spec[0], warps=spec[1])
            )
            try:
                compiled = jax.jit(fn).lower(x).compile()
                err = float(np.abs(np.asarray(compiled(x), np.float32) - reference).max())
                built[name] = (compiled, err)
            except Exception as e:  # a launch shape the lowering refuses is reported, not fatal
                emit({"bench": "layer_norm", "shape": shape, "variant": name, "error": repr(e)[:300]})
        times = {name: [] for name in built}
        for _, name in rotating_rounds(list(built), args.rounds):
            times[name].append(pipelined_ms(built[name][0], x, reps=200))
        moved = 2 * x.nbytes
        for name, (_, err) in built.items():
            ms = float(np.median(times[name]))
            emit(
                {
                    "bench": "layer_norm",
                    "shape": shape,
                    "rows": tokens,
                    "variant": name,
                    "ms": ms,
                    "ms_rounds": [round(t, 4) for t in times[name]],
                    "tb_per_s": moved / ms / 1e9,
                    "max_abs_err_vs_xla": err,
                }
            )


if __name__ == "__main__":
    main()
