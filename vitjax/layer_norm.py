"""LayerNorm in one pass over the rows on CUDA GPUs (Pallas, Triton lowering); XLA's formula elsewhere.

XLA computes a LayerNorm in two passes over x (the moments, then a normalize that reads x again): ~12 ms of a
20-photo call on an H200, where one pass that keeps a block of rows in registers between its statistics and its
output takes ~8 (bench/NOTES.md). Triton loads must be powers of two in size, so a row is read in power-of-two
column pieces (1152 = 1024 + 128). The Triton lowering is named: JAX 0.10 lowers Pallas calls through Mosaic GPU by
default, which refuses these blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# fp32 values a program holds (rows x width): 4 rows of 1152, 1 row of 4608, without spilling registers.
PROGRAM_VALUES = 4608


def pieces(n: int) -> list[tuple[int, int]]:
    """(start, size) power-of-two column pieces covering [0, n), largest first."""
    out, start = [], 0
    for bit in reversed(range(n.bit_length())):
        if n & (1 << bit):
            out.append((start, 1 << bit))
            start += 1 << bit
    return out


def rows_per_program(width: int) -> int:
    """The largest power of two of rows within `PROGRAM_VALUES` (at least 1)."""
    return 1 << max(0, (PROGRAM_VALUES // width).bit_length() - 1)


def _kernel(x_ref, w_ref, b_ref, o_ref, *, eps: float, n: int):
    parts = pieces(n)
    xs = [x_ref[:, pl.ds(s, k)].astype(jnp.float32) for s, k in parts]
    mean = sum(x.sum(axis=1) for x in xs) / n
    var = sum(((x - mean[:, None]) ** 2).sum(axis=1) for x in xs) / n
    inv = jax.lax.rsqrt(var + eps)
    for (s, k), x in zip(parts, xs, strict=True):
        w, b = w_ref[pl.ds(s, k)].astype(jnp.float32), b_ref[pl.ds(s, k)].astype(jnp.float32)
        o_ref[:, pl.ds(s, k)] = ((x - mean[:, None]) * inv[:, None] * w + b).astype(o_ref.dtype)


def one_pass(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    eps: float,
    interpret: bool = False,
    rows: int | None = None,
    warps: int = 4,
) -> jax.Array:
    """`[T, D]` -> LayerNorm over D, fp32 statistics, the result in x's dtype; T a multiple of `rows` a program
    (default `rows_per_program(D)`), each program `warps` warps (the launch shape `bench/bench_layer_norm.py`
    compares). `interpret` runs the kernel's logic anywhere (tests on a CPU)."""
    t, n = x.shape
    rows = rows or rows_per_program(n)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, n=n),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(t // rows,),
        in_specs=[
            pl.BlockSpec((rows, n), lambda i: (i, 0)),
            pl.BlockSpec((n,), lambda i: (0,)),
            pl.BlockSpec((n,), lambda i: (0,)),
        ],
        out_specs=pl.BlockSpec((rows, n), lambda i: (i, 0)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=warps),
        name="layer_norm_one_pass",
    )(x, scale, bias)


def layer_norm(
    x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float, xla: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """`one_pass` where the program is compiled for a CUDA GPU and x is `[T, D]` in whole programs, else
    `xla(x)`: chosen when the program is lowered, so one traced function serves every platform."""
    if x.ndim != 2 or x.shape[0] % rows_per_program(x.shape[1]):
        return xla(x)
    return jax.lax.platform_dependent(x, cuda=lambda x: one_pass(x, scale, bias, eps), default=xla)
