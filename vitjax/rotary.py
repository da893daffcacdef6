"""Qwen3-VL's 2-D rotary position embedding: per-token angles from (row, column) positions, applied with HF's
rotate_half convention in fp32."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


class Rotary(NamedTuple):
    """One packed call's rotary inputs, made once for all blocks: per-token tables for XLA's `apply_rotary`, and the
    positions with tables by position for fa4's in-kernel rotary (`vitjax.fa4_rotary`), whose reads of them stay
    in cache where the per-token tables would stream from memory for every head."""

    cos: jax.Array  # [T, head_dim] fp32, layout [h | w | h | w]
    sin: jax.Array
    positions: jax.Array  # [T, 2] int32: each token's row and column
    cos_at: jax.Array  # [T, head_dim // 4] fp32: row p holds position p's values (p < T)
    sin_at: jax.Array


def _inv_freq(head_dim: int, theta: float) -> np.ndarray:
    half = head_dim // 2
    return (1.0 / (theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))).astype(np.float32)


def rotary_tables(rope_pos: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin `[T, head_dim]` in fp32, layout [h | w | h | w] with head_dim/4 frequencies per axis."""
    angles = (rope_pos.astype(F32)[:, :, None] * _inv_freq(head_dim, theta)).reshape(rope_pos.shape[0], -1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def position_tables(bound: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin `[bound, head_dim // 4]` in fp32 of positions 0..bound-1 at each frequency: what `rotary_tables` gives
    a token at that row or column, bit for bit (the same product and functions), looked up by position."""
    angles = jnp.arange(bound, dtype=F32)[:, None] * _inv_freq(head_dim, theta)
    return jnp.cos(angles), jnp.sin(angles)


def rotary(rope_pos: jax.Array, head_dim: int, theta: float) -> Rotary:
    """`Rotary` for tokens at `rope_pos` `[T, 2]`; positions are below T (a frame's sides are at most its tokens)."""
    return Rotary(
        *rotary_tables(rope_pos, head_dim, theta),
        rope_pos.astype(jnp.int32),
        *position_tables(rope_pos.shape[0], head_dim, theta),
    )


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """rotate_half rotary on `[T, heads, head_dim]`, in fp32, cast back."""
    xf = x.astype(F32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)
