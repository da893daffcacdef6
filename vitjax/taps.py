"""Deepstack taps: the hidden states of a few blocks, kept for the deepstack mergers.

The blocks run as one `scan` (one block compiled), so the write of a block's output into the tap buffer is in every
block's program. XLA's dynamic update there copies the whole `[T, D]` state every block, into a spare slot when the
block is not a tap (3.7 ms of a 20-photo call on an H200). On CUDA GPUs a Pallas kernel (Triton lowering) updates
the buffer in place and returns at once in the other blocks (0.4 ms, bench/NOTES.md); elsewhere a `cond` skips them.
Every slot is written by its tap block before the mergers read it, so on CUDA GPUs the buffer starts unwritten
(zeroing it was another 0.4 ms of that call).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Elements one program copies (128 KiB of bf16), in pieces of `PIECE` that Triton loads at once: few programs to
# launch in the blocks that write nothing.
PROGRAM, PIECE = 1 << 16, 1 << 13


def _kernel(slot_ref, h_ref, _, out_ref, *, taps: int, program: int):
    slot, base = slot_ref[0], pl.program_id(0) * program

    @pl.when(slot < taps)
    def _():
        for j in range(program // PIECE):
            at = pl.ds(base + j * PIECE, PIECE)
            out_ref[slot, at] = h_ref[at]


def in_place(tapped: jax.Array, h: jax.Array, slot: jax.Array, interpret: bool = False) -> jax.Array:
    """`tapped` `[K, T, D]` with `h` `[T, D]` written to `[slot]` when `slot < K`, in place (the buffer is the
    kernel's output); T*D a multiple of `PIECE`. `interpret` runs the kernel's logic anywhere (tests on a CPU)."""
    taps, n = tapped.shape[0], h.size
    program = math.gcd(n, PROGRAM)  # a multiple of PIECE, as n is
    out = pl.pallas_call(
        functools.partial(_kernel, taps=taps, program=program),
        out_shape=jax.ShapeDtypeStruct((taps, n), tapped.dtype),
        grid=(n // program,),
        input_output_aliases={2: 0},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4),
        name="tap_write",
    )(slot.reshape(1), h.reshape(-1), tapped.reshape(taps, n))
    return out.reshape(tapped.shape)


def skipping(tapped: jax.Array, h: jax.Array, slot: jax.Array) -> jax.Array:
    """XLA's form: the dynamic update under a `cond`, so blocks that are not taps write nothing."""
    return jax.lax.cond(
        slot < tapped.shape[0], lambda t: jax.lax.dynamic_update_index_in_dim(t, h, slot, 0), lambda t: t, tapped
    )


def write(tapped: jax.Array, h: jax.Array, slot: jax.Array) -> jax.Array:
    """Block output `h` into tap `slot` of `tapped` `[K, T, D]`; a slot of K or more (a block that is not a tap)
    leaves it as it was. `in_place` where the program is compiled for a CUDA GPU and T*D allows it, else
    `skipping`: chosen when the program is lowered, so one traced function serves every platform."""
    if h.size % PIECE:
        return skipping(tapped, h, slot)
    return jax.lax.platform_dependent(tapped, h, slot, cuda=in_place, default=skipping)


def _leave_unwritten(out_ref):
    del out_ref  # the output's memory keeps whatever it held


def unwritten(shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    """A buffer XLA allocates and nothing writes (a kernel that returns at once): contents undefined."""
    return pl.pallas_call(
        _leave_unwritten,
        out_shape=jax.ShapeDtypeStruct(shape, dtype),
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        grid=(1,),
        compiler_params=pltriton.CompilerParams(num_warps=1),
        name="tap_buffer",
    )()


def buffer(shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    """The tap buffer `[K, T, D]` before the blocks: left unwritten on CUDA GPUs (each slot is written by its tap
    block before anything reads it), zeros elsewhere."""
    return jax.lax.platform_dependent(cuda=lambda: unwritten(shape, dtype), default=lambda: jnp.zeros(shape, dtype))
