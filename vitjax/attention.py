"""Segment-masked (block-diagonal) attention over a packed sequence: every frame attends only to itself.

All implementations share one signature so the tower never knows which one runs:
`attention(q, k, v, segments, impl=...)` with q, k, v `[T, heads, head_dim]` and `segments` from the
host layout. Padding tokens (segment id -1) are never attended by real tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Segments(NamedTuple):
    """Device copy of the packed layout's segment description (see `layout.Packed`)."""

    ids: jax.Array  # [T] int32, -1 for padding
    starts: jax.Array  # [M] int32, T for unused slots
    lengths: jax.Array  # [M] int32, 0 for unused slots


IMPLEMENTATIONS = ("reference",)


def default_implementation() -> str:
    """The fastest implementation available on the default backend."""
    return "reference"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: Segments, impl: str = "reference") -> jax.Array:
    """Block-diagonal softmax attention, scale head_dim**-0.5; returns `[T, heads, head_dim]` in q's dtype."""
    if impl == "reference":
        return _reference(q, k, v, segments.ids)
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLEMENTATIONS}")


def _reference(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array, block: int = 256) -> jax.Array:
    """Portable XLA version: fp32 scores and softmax, one block of queries at a time to bound memory."""
    tokens, heads, dim = q.shape
    block = min(block, tokens)
    padded = -(-tokens // block) * block
    qb = jnp.pad(q, ((0, padded - tokens), (0, 0), (0, 0))).reshape(-1, block, heads, dim)
    ib = jnp.pad(ids, (0, padded - tokens), constant_values=-2).reshape(-1, block)
    precision = jax.lax.Precision.HIGHEST

    def one_block(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        qi, si = args
        scores = jnp.einsum("qhd,khd->hqk", qi, k, preferred_element_type=jnp.float32, precision=precision)
        scores = jnp.where((si[:, None] == ids[None, :])[None], scores * dim**-0.5, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("hqk,khd->qhd", probs, v, preferred_element_type=jnp.float32, precision=precision)
        return out.astype(q.dtype)

    return jax.lax.map(one_block, (qb, ib)).reshape(padded, heads, dim)[:tokens]
