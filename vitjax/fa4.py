"""FlashAttention-4's Hopper (SM90) forward from the `fa4-jax` package (optional extra `fa4`) on a packed sequence.

`vitjax.attention` calls `forward` for its "fa4" path. Segments go to the kernel as `cu_seqlens` with used lengths.
head_dim 72 runs as 80 inside the tile (no copy), and V comes at 80 with the softmax's row sums riding in its column 72
(`attention.value_columns`: the tower makes it so). q and k may come at 80 too, q scaled to log2 units and k with a one
in column 72, the column through which the kernel shifts each row's scores (`attention.query_key_columns`). The
schedule (`Fa4Tile`: tile shape, where P lives, K/V stages, whether V carries the sums) is ours for the head dims in
`FA4_TILES`, FA3's per-head_dim table otherwise; `vitjax.fa4_sums` holds the kernel that takes the sums from V. With
that module, the one place that reaches into fa4-jax's internals (`_route_fa4_schedules`), pinned to `FA4_VERIFIED`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import re
import threading
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

if TYPE_CHECKING:
    from vitjax.attention import Segments

# fa4-jax releases whose Hopper kernel was run and checked against the reference on a GPU.
FA4_VERIFIED = ("0.1.0",)


@dataclasses.dataclass(frozen=True)
class Fa4Tile:
    """One schedule of fa4's Hopper forward: `m` query rows per thread block (64 per MMA warpgroup: 2 or 3 of
    them), `n` keys per step, P handed to the PV GEMM in registers (`p_in_registers`, 'rs') or through shared
    memory ('ss'), `stages` K/V buffers, and `value_sums`: where the tile pads the head dim, V is taken at the tile's
    width with the softmax's row sums carried by its first spare column (`attention.value_columns`,
    `vitjax.fa4_sums`); with them `fixed_shift`: each row's exponentials shifted by its maximum over the first block of
    keys, no running maximum and no rescale of O after it (`forward` catches the rows that would overflow); with that
    `shift_column`: the shift written into Q's first spare column once, against a one in K's, so Q·Kᵀ comes out
    shifted (q and k as `attention.query_key_columns` gives them). Written like "192x144ss", "128x176rs3" (stages when
    not 2), "192x112rs3:vsum", "192x112rs3:vsum:fix" or "192x112rs3:vsum:fix:col"."""

    m: int
    n: int
    p_in_registers: bool
    stages: int = 2
    value_sums: bool = False
    fixed_shift: bool = False
    shift_column: bool = False

    def __post_init__(self):
        if (self.fixed_shift and not self.value_sums) or (self.shift_column and not self.fixed_shift):
            raise ValueError(
                f"fa4 tile {self}: the fixed shift needs the value sums, and the shift column the fixed shift"
            )

    @classmethod
    def parse(cls, text: str) -> Fa4Tile:
        found = re.fullmatch(r"(\d+)x(\d+)(rs|ss)(\d*)(:vsum(:fix(:col)?)?)?", text.strip())
        if found is None:
            raise ValueError(
                f"fa4 tile {text!r}: expected MxN, rs or ss, then optional stages, ':vsum', ':vsum:fix' and "
                "':vsum:fix:col', e.g. 192x144ss or 192x112rs3:vsum:fix:col"
            )
        m, n, mode, stages, sums, fixed, column = found.groups()
        flags = (sums is not None, fixed is not None, column is not None)
        return cls(int(m), int(n), mode == "rs", int(stages or 2), *flags)

    def __str__(self) -> str:
        stages = self.stages if self.stages != 2 else ""
        suffix = (":vsum" if self.value_sums else "") + (":fix" if self.fixed_shift else "")
        suffix += ":col" if self.shift_column else ""
        return f"{self.m}x{self.n}{'rs' if self.p_in_registers else 'ss'}{stages}{suffix}"


def fa4_tile_width(head_dim: int) -> int:
    """The head dim inside fa4's tile: rounded up to 16 (72 runs as 80)."""
    return -(-head_dim // 16) * 16


# Schedules of our own per head_dim (`set_fa4_tile`); head dims not listed keep fa4-jax's table (FA3's). At head_dim
# 72 (the 8B-and-larger towers), P in registers with 112 keys a step and 3 K/V stages: 2-5% faster than FA3's
# 192x144ss (P through shared memory) alone, -0.8% on the 20-photo scan, same errors (H200, `bench_fa4_tiles.py`,
# bench/NOTES.md). FA3 gives head_dim 80-96 P through shared memory because 192x128rs spills there; 112 keys do not.
# V at the tile's width 80 with the row sums in its column 72 (`:vsum`): -10 to -11% alone, -3 to -4% on the 20-photo
# tower device-only (H100, `bench_fa4_sums.py`, `bench_vit.py`). Each row shifted by its first block's maximum
# (`:fix`, where `fa4_call_tile` gives it): -5 to -7% alone, -2 to -4% on the 20 photos and 8 x 1080p (H100). That
# shift written into Q's spare column against a one in K's, q in log2 units (`:col`, `attention.query_key_columns`):
# -11% alone, -3 to -6% on the 20 photos and 8 x 1080p (H100).
FA4_TILES: dict[int, Fa4Tile] = {72: Fa4Tile(192, 112, True, 3, True, fixed_shift=True, shift_column=True)}
# The fixed shift's overflow check costs a call ~0.03 ms a block in control flow, against ~11% of the kernel (with the
# shift column): it pays in buckets of enough attention work, tokens² / slots at least this (the 20-photo bucket, one or
# two 1080p images, 4 and 8 x 720p and larger; not one or two 720p images, nor clip frames). At 10^8 before the shift
# column: 3 x 10^7 took 2-6% off one and two 1080p images and 4 and 8 x 720p (H100, bench/NOTES.md).
FA4_FIXED_SHIFT_MIN_WORK = 3 * 10**7
LN2 = math.log(2.0)


def fa4_version() -> str | None:
    """The installed fa4-jax release, or None."""
    try:
        return importlib.metadata.version("fa4-jax")
    except importlib.metadata.PackageNotFoundError:
        return None


def cu_seqlens(segments: Segments, tokens: int) -> jax.Array:
    """`[M+1]` segment boundaries in the flash-attention "varlen" form: 0, the starts of slots 1..M-1, then T.

    Unused slots start at T, so they are empty; the last frame's slot runs on over the tail padding, which its
    used length (`segments.lengths`) leaves out. Slot 0 always starts at 0 (even when unused: then it is empty
    by its length).
    """
    zero, end = jnp.zeros((1,), jnp.int32), jnp.full((1,), tokens, jnp.int32)
    return jnp.concatenate([zero, segments.starts[1:].astype(jnp.int32), end])


def holds_fixed_shift(dtype: DTypeLike) -> bool:
    """Whether P in `dtype` holds the fixed shift's exponentials (up to 2^64 before the overflow check): bfloat16 has
    float32's range; float16 stops at 2^16, so a later key only 16 (log2 units) past the first block's maximum would
    send the call to the fallback."""
    return jnp.dtype(dtype) == jnp.bfloat16


def fa4_call_tile(head_dim: int, tokens: int, slots: int, dtype: DTypeLike = jnp.bfloat16) -> Fa4Tile | None:
    """The schedule of one fa4 call (None: fa4-jax's own): `FA4_TILES`', without its fixed shift in buckets whose
    attention work cannot repay the overflow check (tokens² / slots below `FA4_FIXED_SHIFT_MIN_WORK`), nor where P
    (in the call's dtype) cannot hold it (`holds_fixed_shift`)."""
    tile = FA4_TILES.get(head_dim)
    small = tokens * tokens < FA4_FIXED_SHIFT_MIN_WORK * slots
    if tile is not None and tile.fixed_shift and (small or not holds_fixed_shift(dtype)):
        return dataclasses.replace(tile, fixed_shift=False, shift_column=False)
    return tile


def forward(q: jax.Array, k: jax.Array, v: jax.Array, segments: Segments, head_dim: int) -> jax.Array:
    """FlashAttention-4's packed forward; padding rows (outside every used length) are left unwritten. q and k at
    `head_dim`, or widened (`attention.query_key_columns`): then the kernel's scale is the one that leaves q's log2
    units. The output comes at `head_dim` (`_output_width`), also where v is widened.

    Under a `fixed_shift` schedule a row whose scores outgrow its first block's maximum by far enough to risk overflow
    comes back with a NaN log-sum-exp; then the call runs again with the same schedule's online maximum, so the result
    is the same either way. That check runs in a `while_loop`, which JAX differentiates forward only: the tower is an
    inference path."""
    from fa4_jax import flash_attn_varlen

    _route_fa4_schedules()
    tokens, widened = q.shape[0], q.shape[-1] != head_dim
    tile = fa4_call_tile(head_dim, tokens, segments.starts.shape[0], q.dtype)
    if tile is not None and tile.shift_column and not widened:  # q and k as they are: no column to shift through
        tile = dataclasses.replace(tile, shift_column=False)
    cu, used = cu_seqlens(segments, tokens), segments.lengths
    scale = LN2 if widened else head_dim**-0.5

    def call(tile: Fa4Tile | None, **kw) -> jax.Array:
        mark = _mark(tile, head_dim)
        return flash_attn_varlen(q, k, v, cu, cu, seqused_q=used, seqused_k=used, scale=scale, mask_mod=mark, **kw)

    if tile is None or not tile.fixed_shift or not _sums_kernel(tile, head_dim, v.shape[-1]):
        return call(tile)
    out, lse = call(tile, return_lse=True)
    overflowed = jnp.any(jnp.isnan(lse) & (segments.ids >= 0)[None])
    online = dataclasses.replace(tile, fixed_shift=False, shift_column=False)
    # A loop run at most once rather than `lax.cond`: XLA passes the output through it in place, where the cond's
    # untaken branch copied it (`bench_fa4_guard.py`: +0.03 ms a block against +0.17).
    return jax.lax.while_loop(lambda carry: carry[1], lambda _: (call(online), jnp.bool_(False)), (out, overflowed))[0]


@functools.cache
def _schedule_mask() -> type:
    """A mask mod that allows every pair and names an fa4 schedule and the head dim before any widening. fa4-jax keys
    its kernels by a mask's class and static fields, so `forward` hands each call its schedule this way;
    `_route_fa4_schedules` builds our kernel for it, without a mask."""
    from fa4_jax import MaskMod
    from fa4_jax.masks import static

    @dataclasses.dataclass(frozen=True)
    class Schedule(MaskMod):
        tile: str = static()
        head_dim: int = static()

        def __call__(self, b, h, q_idx, kv_idx):
            return q_idx == q_idx  # every pair

    return Schedule


def _mark(tile: Fa4Tile | None, head_dim: int):
    return None if tile is None else _schedule_mask()(str(tile), head_dim)


def _marked(mask) -> tuple[Fa4Tile, int] | None:
    """The schedule and head dim a call's mask (fa4-jax's treedef of it) names, if it is `_mark`'s."""
    if mask is None or mask.num_leaves:
        return None
    mark = mask.unflatten(())
    return (Fa4Tile.parse(mark.tile), mark.head_dim) if isinstance(mark, _schedule_mask()) else None


def _sums_kernel(tile: Fa4Tile, head_dim: int, width_v: int) -> bool:
    """Whether a call under `tile` runs `vitjax.fa4_sums`' kernel: a value-sums schedule given V wider than the head dim
    (its sum column). Only that kernel takes the fixed shift; it divides O by the column and writes O at head_dim."""
    return tile.value_sums and width_v > head_dim


def _output_width(mask, width: int) -> int:
    """O's width for an fa4 call with V `width` wide and `mask` (fa4-jax's treedef of its mask mod): the head dim before
    widening where the call's schedule (`_mark`) takes the row sums from V's spare column, since the kernel divides
    O by that column and its store (TMA, which drops what falls outside the tensor) leaves the spare columns out; the
    projection then reads the attention as HF's weights take it (K = 1152, not 1280 with zero rows). Else V's."""
    marked = _marked(mask)
    return marked[1] if marked and _sums_kernel(*marked, width) else width


# The output width of the fa4 call this thread is lowering (`_narrowed`): buckets compile on several threads at once.
_LOWERING = threading.local()


def _narrowed(method):
    """fa4-jax's `CuteBackend.fwd` or `fwd_lse`, its output buffer (`_sized_output`) at `_output_width`."""

    @functools.wraps(method)
    def call(self, cfg, q, k, v, aux, seqlens=None):
        _LOWERING.width = _output_width(cfg.mask, v.shape[-1])
        try:
            return method(self, cfg, q, k, v, aux, seqlens)
        finally:
            _LOWERING.width = None

    return call


def _sized_output(q, v) -> jax.ShapeDtypeStruct:
    """fa4-jax's `CuteBackend._out_struct` (which sizes the output by V) at the width `_narrowed` set for this thread's
    call, else V's."""
    width = getattr(_LOWERING, "width", None) or v.shape[-1]
    return jax.ShapeDtypeStruct((*q.shape[:-1], width), q.dtype)


def set_fa4_tile(head_dim: int, tile: Fa4Tile | None) -> None:
    """Use `tile` for fa4's Hopper forward at `head_dim` from the next trace on (None: fa4-jax's own table).
    Programs compiled before keep the kernel they were traced with."""
    if tile is None:
        FA4_TILES.pop(head_dim, None)
    else:
        FA4_TILES[head_dim] = tile
    if _route_fa4_schedules.cache_info().currsize:
        from fa4_jax import kernels

        kernels._get_static.cache_clear()  # its memo holds the kernel objects built with the old schedule


@functools.cache
def _route_fa4_schedules() -> None:
    """fa4-jax 0.1.0 builds the Hopper forward with FA3's tile for the head dim (`fa4_jax.kernels._get_fwd`, keyed
    on head_dim only); route the plain (non-causal) forwards through our schedule instead: the one `forward` names
    (`_mark`), or for calls without a mask the head dim's in `FA4_TILES`. Calls `forward` names get their output at
    `_output_width`: the forward primitive's shape rule and the backend's output buffer both size it by V upstream.
    The one place that reaches into fa4-jax's internals: checked on `FA4_VERIFIED`."""
    from fa4_jax import attention as fa4_attention
    from fa4_jax import kernels

    upstream = kernels._get_fwd

    @functools.wraps(upstream)
    def get_fwd(dtype, head_dim, head_dim_v, qhead_per_kvhead, causal, local, mask_mod, n_aux, arch, varlen=False):
        tile, dim = _marked(mask_mod) or (FA4_TILES.get(head_dim) if mask_mod is None else None, head_dim)
        ours = tile is not None and arch // 10 == 9 and not (causal or local)
        if not ours or {head_dim, head_dim_v} - {dim, fa4_tile_width(dim)}:
            return upstream(dtype, head_dim, head_dim_v, qhead_per_kvhead, causal, local, mask_mod, n_aux, arch, varlen)
        return _fa4_sm90_forward(tile, dtype, dim, head_dim_v, qhead_per_kvhead, n_aux > 0, width=head_dim)

    kernels._get_fwd = get_fwd
    shapes = fa4_attention._fwd_abstract

    def shape_rule(*args, cfg, need_lse):
        out, *rest = shapes(*args, cfg=cfg, need_lse=need_lse)
        return (out.update(shape=(*out.shape[:-1], _output_width(cfg.mask, out.shape[-1]))), *rest)

    fa4_attention.fa4_fwd_p.def_abstract_eval(shape_rule)
    kernels.CuteBackend.fwd = _narrowed(kernels.CuteBackend.fwd)
    kernels.CuteBackend.fwd_lse = _narrowed(kernels.CuteBackend.fwd_lse)
    kernels.CuteBackend._out_struct = staticmethod(_sized_output)


@functools.cache
def _fa4_sm90_forward(
    tile: Fa4Tile, dtype, head_dim: int, head_dim_v: int, qhead_per_kvhead: int, aux: bool, width: int | None = None
):
    """The Hopper forward kernel object for one schedule, V at `head_dim` or at the tile's width (then with the row
    sums from its spare column under a `value_sums` schedule), q and k at `width` (`head_dim` or the tile's width,
    `attention.query_key_columns`); refused before launch when its buffers do not fit in shared memory (an oversized
    launch fails inside CUDA and poisons the context)."""
    from fa4_jax.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    width = width or head_dim
    threads = (tile.m // 64 + 1) * 128  # one MMA warpgroup per 64 rows, plus the producer's
    args = (dtype, width, head_dim_v, tile.m, tile.n, tile.stages, threads, False)
    if not FlashAttentionForwardSm90.can_implement(*args, mma_pv_is_rs=tile.p_in_registers):
        raise ValueError(f"fa4 tile {tile} does not fit on this GPU at head_dim {head_dim}")
    kind = FlashAttentionForwardSm90
    if _sums_kernel(tile, head_dim, head_dim_v):
        from vitjax import fa4_sums

        kind = fa4_sums.forward_class(head_dim, tile.fixed_shift, tile.shift_column and width > head_dim)
    return kind(
        dtype,
        width,
        head_dim_v,
        qhead_per_kvhead,
        is_causal=False,
        is_local=False,
        pack_gqa=False,
        tile_m=tile.m,
        tile_n=tile.n,
        num_stages=tile.stages,
        num_threads=threads,
        Q_in_regs=False,
        intra_wg_overlap=True,
        mma_pv_is_rs=tile.p_in_registers,
        mask_mod=None,
        has_aux_tensors=aux,
    )
