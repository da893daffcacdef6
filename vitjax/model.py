"""The Qwen3-VL vision tower in Flax NNX, as pure functions of (params, packed inputs).

Module and parameter names mirror HF's `Qwen3VLVisionModel` so the weight map stays a rename; the blocks
(and the deepstack mergers) are stacked along a leading axis and run under `jax.lax.scan`, so a
27-block tower compiles one block.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vitjax.attention import Segments, attention, query_key_columns, value_columns, widen
from vitjax.config import VisionConfig
from vitjax.layer_norm import layer_norm
from vitjax.taps import buffer as tap_buffer
from vitjax.taps import write as tap_write

F32 = jnp.float32


class TowerInputs(NamedTuple):
    """Device side of `layout.Packed`."""

    pos_index: jax.Array
    pos_weight: jax.Array
    rope_pos: jax.Array
    segments: Segments


def _precision(dtype: jnp.dtype) -> jax.lax.Precision:
    """float32 means float32 (no TF32) so parity tests mean something; bf16 uses the fast path."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else jax.lax.Precision.DEFAULT


# GEMM widths are zero-padded to a multiple of this where the model allows it exactly (the MLP's hidden width):
# on an H200 cuBLASLt ran fc1 at ~600 TFLOP/s with N = 4304 (8B and larger), ~740 with 4352; on an H100 both
# the same (bench/NOTES.md).
GEMM_WIDTH_MULTIPLE = 256


def _linear(din: int, dout: int, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, dtype=dtype, param_dtype=dtype, precision=_precision(dtype), rngs=rngs)


def _dense(layer: nnx.Linear, x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """`layer`'s matmul with a kernel and bias derived from its own (a slice, a padded copy)."""
    return jnp.dot(x, kernel, precision=layer.precision) + bias


class _LayerNorm(nnx.LayerNorm):
    """LayerNorm (eps 1e-6) computed in fp32 whatever the activation dtype, result cast back; in one pass on
    CUDA GPUs (`vitjax.layer_norm`)."""

    def __init__(self, dim: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(dim, epsilon=1e-6, dtype=F32, param_dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...], self.epsilon, self.xla)

    def xla(self, x: jax.Array) -> jax.Array:
        """XLA's LayerNorm (two passes over x)."""
        return super().__call__(x).astype(x.dtype)


class PatchEmbed(nnx.Module):
    """HF's Conv3d with kernel == stride is a matmul on the 1536-wide pixel rows; rows are (c, t, ph, pw)."""

    def __init__(self, cfg: VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.proj = _linear(cfg.patch_dim, cfg.hidden_size, dtype, rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        return self.proj(pixels.astype(self.proj.param_dtype))


class Attention(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = _linear(cfg.hidden_size, 3 * cfg.hidden_size, dtype, rngs)
        self.proj = _linear(cfg.hidden_size, cfg.hidden_size, dtype, rngs)

    def qk_v(self, x: jax.Array, extra: tuple[float, ...] = ()) -> tuple[jax.Array, jax.Array]:
        """q|k `[T, 2, heads, head_dim]` and v `[T, heads, head_dim + len(extra)]` from two GEMMs over the one stored
        kernel: v lands in a buffer of its own, which the attention kernel reads as it is (one product would leave v
        to be copied out of it: bench/NOTES.md). `extra`: columns appended to every head of v, made by zero weights
        and these values as bias (`attention.value_columns`)."""
        w, b, d = self.qkv.kernel[...], self.qkv.bias[...], x.shape[-1]
        qk = _dense(self.qkv, x, w[:, : 2 * d], b[: 2 * d]).reshape(x.shape[0], 2, self.num_heads, self.head_dim)
        wv, bv = w[:, 2 * d :], b[2 * d :]
        if extra:
            wv = jnp.pad(wv.reshape(d, self.num_heads, -1), ((0, 0), (0, 0), (0, len(extra)))).reshape(d, -1)
            bv = widen(bv.reshape(self.num_heads, -1), extra).reshape(-1)
        v = _dense(self.qkv, x, wv, bv).reshape(x.shape[0], self.num_heads, -1)
        return qk, v

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: Segments, impl: str) -> jax.Array:
        extra = value_columns(impl, self.head_dim)
        qk, v = self.qk_v(x, extra)
        scale, q_extra, k_extra = query_key_columns(impl, self.head_dim, qk.dtype)
        q = apply_rotary(qk[:, 0], cos * scale, sin * scale, q_extra)  # scaled before q's one rounding
        k = apply_rotary(qk[:, 1], cos, sin, k_extra)
        return self.proj(attention(q, k, v, segments, impl, self.head_dim).reshape(x.shape[0], -1))


class MLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.linear_fc1 = _linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        self.linear_fc2 = _linear(cfg.intermediate_size, cfg.hidden_size, dtype, rngs)

    def _pad(self) -> int:
        """Zero columns added to fc1 and zero rows to fc2 to reach `GEMM_WIDTH_MULTIPLE`: GELU(0) = 0 meets the
        zero rows, so the result is unchanged."""
        return -self.linear_fc1.kernel.shape[1] % GEMM_WIDTH_MULTIPLE

    def up(self, x: jax.Array) -> jax.Array:
        """GELU(fc1(x)) at the padded width. tanh-GELU on fc1's output dtype: on GPUs XLA makes it the GEMM's
        cuBLASLt epilogue, evaluated in fp32 on the accumulator before the one rounding (bench/NOTES.md: -3.6%
        tower time); in fp32 it is exact."""
        pad = self._pad()
        w1 = jnp.pad(self.linear_fc1.kernel[...], ((0, 0), (0, pad)))
        b1 = jnp.pad(self.linear_fc1.bias[...], (0, pad))
        return jax.nn.gelu(_dense(self.linear_fc1, x, w1, b1), approximate=True)

    def down(self, h: jax.Array) -> jax.Array:
        w2 = jnp.pad(self.linear_fc2.kernel[...], ((0, self._pad()), (0, 0)))
        return _dense(self.linear_fc2, h, w2, self.linear_fc2.bias[...])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.up(x))


class Block(nnx.Module):
    """Pre-norm transformer block with 2-D rotary, segment-masked attention and a tanh-GELU MLP."""

    def __init__(self, cfg: VisionConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.norm1 = _LayerNorm(cfg.hidden_size, dtype, rngs)
        self.norm2 = _LayerNorm(cfg.hidden_size, dtype, rngs)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: Segments, impl: str) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, segments, impl)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """2x2 patches -> one token. The final merger normalizes per patch (D) before the shuffle; the deepstack
    mergers normalize the shuffled 4D vector. Both use exact (erf) GELU."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool, dtype: jnp.dtype, rngs: nnx.Rngs):
        wide = cfg.hidden_size * cfg.merge_unit
        self.postshuffle = postshuffle
        self.norm = _LayerNorm(wide if postshuffle else cfg.hidden_size, dtype, rngs)
        self.linear_fc1 = _linear(wide, wide, dtype, rngs)
        self.linear_fc2 = _linear(wide, cfg.out_hidden_size, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        wide = self.linear_fc1.in_features
        x = self.norm(x.reshape(-1, wide)) if self.postshuffle else self.norm(x).reshape(-1, wide)
        h = self.linear_fc1(x)
        return self.linear_fc2(exact_gelu(h))


def exact_gelu(h: jax.Array) -> jax.Array:
    """GELU as PyTorch's `nn.GELU()` computes it, x/2 · (1 + erf(x/√2)) in fp32, cast back. `jax.nn.gelu`'s
    erfc form is exact too but costs XLA several times the arithmetic: on an H200 the 20-photo call's merger
    GELUs took 1.7 ms in that form, far above the pass's memory time (bench/NOTES.md)."""
    x = h.astype(F32)
    return (0.5 * x * (1.0 + jax.lax.erf(x * np.float32(np.sqrt(0.5))))).astype(h.dtype)


def rotary_tables(rope_pos: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin `[T, head_dim]` in fp32, layout [h | w | h | w] with head_dim/4 frequencies per axis."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))
    angles = (rope_pos.astype(F32)[:, :, None] * inv_freq.astype(np.float32)).reshape(rope_pos.shape[0], half)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array, extra: tuple[float, ...] = ()) -> jax.Array:
    """rotate_half rotary on `[T, heads, head_dim]`, in fp32, cast back, with `extra` columns appended to every head
    (`attention.query_key_columns`). Written as one concatenation of the two rotated halves and the extra columns
    (cos and sin repeat over the halves): XLA fuses that into a single pass, where a concatenation after the rotary's
    own took 1.2x its time (H100, bench/NOTES.md)."""
    xf = x.astype(F32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    half = x1.shape[-1]
    c, s = cos[:, None, :half], sin[:, None, :half]
    pieces = [x1 * c - x2 * s, x2 * c + x1 * s]
    if extra:
        pieces.append(jnp.broadcast_to(jnp.asarray(extra, F32), (*x.shape[:-1], len(extra))))
    return jnp.concatenate(pieces, axis=-1).astype(x.dtype)


def _stacked(make, count: int, rngs: nnx.Rngs):
    """`count` copies of a module with parameters stacked on a leading axis (for scan / vmap)."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def build(key: jax.Array):
        return make(nnx.Rngs(key))

    return build(jax.random.split(rngs.params(), count))


class VisionTower(nnx.Module):
    """Qwen3VLVisionModel: pixel rows of a packed sequence -> `[T/4, out_hidden * (1 + #deepstack)]`,
    columns `[merger | deepstack_0 | ...]` (SGLang's layout)."""

    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype = F32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.patch_embed = PatchEmbed(cfg, dtype, rngs)
        self.pos_embed = nnx.Embed(cfg.num_position_embeddings, cfg.hidden_size, param_dtype=dtype, rngs=rngs)
        self.blocks = _stacked(lambda r: Block(cfg, dtype, r), cfg.depth, rngs)
        self.merger = PatchMerger(cfg, False, dtype, rngs)
        taps = len(cfg.deepstack_visual_indexes)
        self.deepstack_merger_list = _stacked(lambda r: PatchMerger(cfg, True, dtype, r), taps, rngs) if taps else None

    def position_embedding(self, pos_index: jax.Array, pos_weight: jax.Array) -> jax.Array:
        """Bilinear interpolation of the learned table at each token's taps, in fp32: `[T, D]`."""
        table = self.pos_embed.embedding[...]
        return (table[pos_index].astype(F32) * pos_weight[..., None]).sum(axis=1)

    def embed(self, pixels: jax.Array, inputs: TowerInputs) -> jax.Array:
        """Patch embed plus the interpolated position embedding (fp32 sum, one cast)."""
        x = self.patch_embed(pixels)
        return x + self.position_embedding(inputs.pos_index, inputs.pos_weight).astype(x.dtype)

    def run_blocks(self, x: jax.Array, inputs: TowerInputs, impl: str = "reference") -> tuple[jax.Array, jax.Array]:
        """All blocks under one `scan` (one block compiled). Returns the last hidden state and the deepstack taps
        `[K, T, D]`: tap blocks write their output to their slot (`vitjax.taps`), the others to none (slot K)."""
        cfg = self.cfg
        cos, sin = rotary_tables(inputs.rope_pos, cfg.head_dim, cfg.rope_theta)
        taps = len(cfg.deepstack_visual_indexes)
        slots = np.full(cfg.depth, taps, np.int32)
        slots[list(cfg.deepstack_visual_indexes)] = np.arange(taps)
        graph, params = nnx.split(self.blocks)

        def step(carry, xs):
            h, tapped = carry
            block_params, slot = xs
            h = nnx.merge(graph, block_params)(h, cos, sin, inputs.segments, impl)
            return (h, tap_write(tapped, h, slot) if taps else tapped), None

        tapped = tap_buffer((taps, *x.shape), x.dtype)
        (x, tapped), _ = jax.lax.scan(step, (x, tapped), (params, jnp.asarray(slots)))
        return x, tapped

    def merge(self, x: jax.Array, tapped: jax.Array) -> jax.Array:
        """Final merger on the last hidden state, deepstack mergers on the taps, side by side."""
        taps = len(self.cfg.deepstack_visual_indexes)
        outputs = [self.merger(x)]
        if taps:
            graph, params = nnx.split(self.deepstack_merger_list)
            outputs.extend(jax.vmap(lambda p, h: nnx.merge(graph, p)(h))(params, tapped))
        return jnp.concatenate(outputs, axis=-1)

    def __call__(self, pixels: jax.Array, inputs: TowerInputs, impl: str = "reference") -> jax.Array:
        return self.merge(*self.run_blocks(self.embed(pixels, inputs), inputs, impl))
