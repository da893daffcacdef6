"""fa4's Hopper forward with q's rotary done inside the kernel: each thread block rotates its Q tile in shared memory
once, after the tile lands and before the first Q·Kᵀ, so XLA's pass over q (read and write every q, ~3.4 ms of a
20-photo call at head_dim 72) goes, and q is read in place from the q|k GEMM output (no copy out of it).

Needs the `fa4` extra (CuTe DSL); imported only when that path runs. Built on fa4-jax's `FlashAttentionForwardSm90`
and on the order of calls in its `mma` (see `RotatingQForwardSm90`): checked on `attention.FA4_VERIFIED`.
"""

from __future__ import annotations

import dataclasses

import cutejax
import cutlass
import jax
from cutlass import Constexpr, Float32, cute
from fa4_jax.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from fa4_jax.cute.named_barrier import NamedBarrierFwd
from fa4_jax.cute.utils import AuxData

WARPGROUP = 128
ROWS_PER_WARPGROUP = 64  # each MMA warpgroup computes (and reads Q for) 64 rows of the tile
AXES = 2  # a token's row and column: two threads per row of the tile, one per axis's frequencies
VECTOR = 2  # columns a thread reads and writes at once (4 bytes: no 16-byte swizzle chunk splits them)
# Named barriers 7-9, one per MMA warpgroup, after the ones fa4's forward uses (1-6).
ROTARY_BARRIER = max(NamedBarrierFwd) + 1
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}  # the element types fa4 takes, by JAX name

_TOKENS_SPEC = cutejax.ArraySpec(static_dims=(1, 2))  # [T, heads, head_dim]: T symbolic, as fa4-jax's varlen calls
_QK_SPEC = cutejax.ArraySpec(static_dims=(1, 2, 3))  # [T, 2, heads, head_dim]
_TABLE_SPEC = cutejax.ArraySpec(static_dims=(1,))  # [T, 2] positions, [T, head_dim // 4] tables by position


@dataclasses.dataclass(frozen=True)
class _RotateQTile:
    """Stands in for the block-info and Q-pipeline objects `mma` is given, to run the rotation at the two points it
    needs: `get_n_block_min_max(seqlen, m_block)` (the tile's first rows known: its angles are loaded then, so the
    loads overlap Q's arrival) and `consumer_wait_w_index_phase` (Q in shared memory: rotate, then make the stores
    visible to the wgmma reads of this warpgroup). Frozen, as the DSL requires of what its loops only read; the
    angles loaded for the current tile wait in `pending`.

    Each thread takes one row and one axis: the columns of that axis's frequencies in the first half, and their
    partners in the second. It reads the row's position on its axis, then the angles at that position from the
    tables by position (`vitjax.rotary.Rotary`): a few KB that stay in cache for every head."""

    kernel: RotatingQForwardSm90
    sQ: cute.Tensor
    tables: tuple  # positions [T, 2], cos and sin [T, head_dim // 4] by position
    tidx: cutlass.Int32
    block_info: object
    pipeline_q: object
    pending: list = dataclasses.field(default_factory=list)

    def get_n_block_min_max(self, seqlen, m_block, *args, **kwargs):
        positions, cos, sin = self.tables
        row, axis = self._row_and_axis()
        position = positions[self.token(seqlen, m_block, row), axis]
        self.pending.clear()
        for col in range(0, self.kernel.rotary_half // AXES, VECTOR):
            angles = (cute.local_tile(table[position, None], (VECTOR,), (col // VECTOR,)) for table in (cos, sin))
            self.pending.append(tuple(a.load() for a in angles))
        return self.block_info.get_n_block_min_max(seqlen, m_block, *args, **kwargs)

    def consumer_wait_w_index_phase(self, *args, **kwargs):
        self.pipeline_q.consumer_wait_w_index_phase(*args, **kwargs)
        half, dtype = self.kernel.rotary_half, self.kernel.dtype
        row, axis = self._row_and_axis()
        q_row, first = self.sQ[row, None], axis * (half // AXES)
        cols = [first + col for col in range(0, half // AXES, VECTOR)]
        xs = [cute.local_tile(q_row, (VECTOR,), (col // VECTOR,)) for col in cols]
        ys = [cute.local_tile(q_row, (VECTOR,), ((col + half) // VECTOR,)) for col in cols]
        # All loads before any store: the compiler cannot tell the swizzled addresses apart, so interleaving them
        # would serialize every pair on the shared-memory latency.
        pairs = [(x.load().to(Float32), y.load().to(Float32)) for x, y in zip(xs, ys, strict=True)]
        for x_out, y_out, (x, y), (c, s) in zip(xs, ys, pairs, self.pending, strict=True):
            # HF's rotate_half in fp32: (x, y) -> (x cos - y sin, y cos + x sin), one rounding to the dtype.
            x_out.store((x * c - y * s).to(dtype))
            y_out.store((y * c + x * s).to(dtype))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=ROTARY_BARRIER + self.tidx // WARPGROUP, number_of_threads=WARPGROUP)

    def _row_and_axis(self):
        """This thread's row of the tile and its axis (0: the row's frequencies, 1: the column's)."""
        warpgroup, lane = self.tidx // WARPGROUP, self.tidx % WARPGROUP
        return warpgroup * ROWS_PER_WARPGROUP + lane // AXES, lane % AXES

    def token(self, seqlen, m_block, row):
        """The packed-sequence token of a tile row. Rows past the sequence (the last tile's tail, zero-filled by TMA)
        read the last token's position."""
        return cutlass.min(seqlen.offset_q + m_block * self.kernel.tile_m + row, self.tables[0].shape[0] - 1)

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copies and pickles look for these before the fields exist
            raise AttributeError(name)
        # The rest (the Q pipeline's release, block info's other ranges) are the wrapped objects' own.
        for inner in (self.block_info, self.pipeline_q):
            if hasattr(inner, name):
                return getattr(inner, name)
        raise AttributeError(name)


class RotatingQForwardSm90(FlashAttentionForwardSm90):
    """The Hopper forward, given each token's positions and cos/sin tables by position (`vitjax.rotary.Rotary`) as
    its three aux tensors, with each tile of q rotated on arrival (rows are tokens of the packed sequence: the tile's
    segment offset plus its row). Only the consumer side changes: `mma` runs as upstream with its block info and Q
    pipeline wrapped (`_RotateQTile`), and without aux tensors, so no mask or score mod sees them."""

    rotation = _RotateQTile  # what wraps `mma`'s block info and Q pipeline (bench/bench_fa4_rotary.py swaps it)

    def __init__(self, *args, head_dim: int, **kwargs):
        super().__init__(*args, **kwargs)
        if head_dim % (2 * AXES * VECTOR) or ROWS_PER_WARPGROUP * AXES != WARPGROUP or self.pack_gqa:
            raise ValueError(f"q rotary in fa4 needs head_dim % 8 == 0 and no packed GQA (head_dim {head_dim})")
        self.rotary_half = head_dim // 2

    def mma(self, tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, sVt, sP, sO, learnable_sink, pipeline_k, pipeline_v,
            pipeline_q, gmem_tiled_copy_O, tma_atom_O, tidx, softmax_scale_log2, softmax_scale, block_info,
            SeqlenInfoCls, AttentionMaskCls, TileSchedulerCls, blocksparse_tensors, aux_data,
            fastdiv_mods=None):  # fmt: skip
        rotate = self.rotation(self, sQ, tuple(aux_data.tensors), tidx, block_info, pipeline_q)
        return super().mma(
            tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, sVt, sP, sO, learnable_sink, pipeline_k, pipeline_v, rotate,
            gmem_tiled_copy_O, tma_atom_O, tidx, softmax_scale_log2, softmax_scale, rotate, SeqlenInfoCls,
            AttentionMaskCls, TileSchedulerCls, blocksparse_tensors, AuxData(), fastdiv_mods,
        )  # fmt: skip


@cute.jit
def _forward(stream, qk, k, v, cu, used, positions, cos, sin, out, *, kernel: Constexpr, scale: Constexpr):
    """q is qk's first plane read in place: `[T, heads, head_dim]` at a token stride of 2 * heads * head_dim."""
    q = qk[None, 0, None, None]
    kernel(
        q, k, v, out, None, scale,
        mCuSeqlensQ=cu, mCuSeqlensK=cu, mSeqUsedQ=used, mSeqUsedK=used,
        window_size_left=None, window_size_right=None,
        aux_data=AuxData(tensors=(positions, cos, sin)), stream=stream,
    )  # fmt: skip


def attention(kernel: RotatingQForwardSm90, qk, k, v, cu, used, tables) -> jax.Array:
    """Packed attention of q = rotary(qk[:, 0]) (rotated in the kernel) against the already rotated k, and v;
    `cu`/`used` as `attention.cu_seqlens` and `Segments.lengths`, `tables` (positions, cos, sin by position) from
    `vitjax.rotary.Rotary`. Rows outside every used length are left unwritten."""
    return cutejax.call(
        _forward,
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        qk, k, v, cu, used, *tables,
        in_specs=[_QK_SPEC, _TOKENS_SPEC, _TOKENS_SPEC, None, None, _TABLE_SPEC, _TABLE_SPEC, _TABLE_SPEC],
        out_specs=_TOKENS_SPEC,
        name="vitjax_fa4_rotating_q",
        kernel=kernel,
        scale=qk.shape[-1] ** -0.5,
    )  # fmt: skip
