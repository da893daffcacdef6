"""Segment-masked (block-diagonal) attention over a packed sequence: every frame attends only to itself.

All implementations share one signature so the tower never knows which one runs:
`attention(q, k, v, segments, impl=...)` with q, k, v `[T, heads, head_dim]` and `segments` from the
host layout. Padding tokens (segment id -1) are never attended by real tokens; their own outputs are
unspecified (the cuDNN paths leave them unwritten) and are dropped by the caller.

- `fa4`: FlashAttention-4's Hopper forward on the packed sequence (`vitjax.fa4`, optional extra `fa4`), with our
  schedules at head_dim 72 and q, k and v as `query_key_columns` and `value_columns` ask. The default on Hopper where
  installed (`bench/NOTES.md` has the measurements), pinned like the cuDNN entry point to the release it was checked on.
- `cudnn_packed`: cuDNN flash attention on the packed `[1, T, heads, head_dim]` sequence with per-segment
  offsets and lengths (its ragged "THD" layout). Only JAX's private cuDNN module exposes offsets, so the
  import is guarded and pinned to the JAX versions it was verified on.
- `cudnn_padded`: the public `jax.nn.dot_product_attention(implementation="cudnn")` over segments
  gathered into a padded batch `[M, L, heads, head_dim]` with per-row lengths, scattered back after.
- `reference`: portable XLA (CPU, tests, float32 towers): fp32 scores, each block of queries against the keys of
  its own frames.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from vitjax import fa4

IMPLEMENTATIONS = ("fa4", "cudnn_packed", "cudnn_padded", "reference")
GPU_ONLY = IMPLEMENTATIONS[:3]  # kernels for CUDA GPUs; "reference" is XLA's, for any device
ENV_VAR = "VITJAX_ATTENTION"
# Buckets of more segment slots than this hold a video's temporal slices (~480 patches each at HF's defaults), where
# fa4's 192 x 112 tiles compute ~30% padding and its scheduler pays for every unused slot: the automatic choice gives
# them to cuDNN's packed path, 2-5% faster on such towers on an H200 (bench/NOTES.md).
FA4_MAX_SEGMENTS = 64
# JAX releases on which the private packed entry point was run and checked against the reference on a GPU.
CUDNN_PACKED_VERIFIED = ("0.11.2",)
# What the flash kernels take (fa4's and cuDNN's); a tower in another dtype (float32) runs XLA's path.
FLASH_DTYPES = ("bfloat16", "float16")


def _flash_takes(dtype: DTypeLike | None) -> bool:
    """Whether the flash paths run towers of `dtype` (None: not known yet, taken as yes)."""
    return dtype is None or jnp.dtype(dtype).name in FLASH_DTYPES


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["ids", "starts", "lengths"], meta_fields=["max_length", "seq_axis"]
)
@dataclasses.dataclass(frozen=True)
class Segments:
    """Device copy of the packed layout's segment description (see `layout.Packed`), always of the whole
    sequence.

    Static (part of the compiled program): `max_length`, the longest segment the padded-batch path must
    hold (0: the whole sequence); `seq_axis`, the mesh axis the tokens are split over inside `shard_map`
    (Ulysses sequence parallelism), or None.
    """

    ids: jax.Array  # [T] int32, -1 for padding
    starts: jax.Array  # [M] int32, T for unused slots
    lengths: jax.Array  # [M] int32, 0 for unused slots
    max_length: int = 0
    seq_axis: str | None = None


def _packed_entry():
    """JAX's private cuDNN attention with segment offsets, or None where it cannot be used here."""
    if jax.__version__ not in CUDNN_PACKED_VERIFIED:
        return None
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    except ImportError:
        return None
    return dot_product_attention, MaskType


def _capabilities() -> list[str]:
    return [str(getattr(d, "compute_capability", "0")) for d in jax.local_devices()]


def select_implementation(backend: str, capabilities: list[str], fa4_release: str | None, packed_entry: bool) -> str:
    """The default path from the facts: fa4 where every device is a Hopper GPU (9.x, the kernel family that was
    measured) and a verified fa4-jax is installed; else cuDNN packed on Hopper or newer where JAX's private entry
    point is usable (`packed_entry`); else cuDNN over a padded batch on GPUs; XLA elsewhere."""
    if backend != "gpu":
        return "reference"
    hopper = bool(capabilities) and all(c.split(".")[0] == "9" for c in capabilities)
    if hopper and fa4_release in fa4.FA4_VERIFIED:
        return "fa4"
    if packed_entry and capabilities and all(float(c) >= 9.0 for c in capabilities):
        return "cudnn_packed"
    return "cudnn_padded"


@functools.cache
def _auto() -> str:
    if jax.default_backend() != "gpu":
        return "reference"
    found, entry = fa4.fa4_version(), _packed_entry() is not None
    impl = select_implementation("gpu", _capabilities(), found, entry)
    if found is not None and found not in fa4.FA4_VERIFIED:
        warnings.warn(
            f"fa4 attention is verified with fa4-jax {', '.join(fa4.FA4_VERIFIED)} only (found {found})", stacklevel=3
        )
    if impl == "cudnn_padded" and not entry:
        warnings.warn(
            f"cuDNN packed attention is verified on JAX {', '.join(CUDNN_PACKED_VERIFIED)} only (found "
            f"{jax.__version__}); using the padded-batch cuDNN path instead",
            stacklevel=3,
        )
    return impl


def default_implementation(dtype: DTypeLike | None = None) -> str:
    """`$VITJAX_ATTENTION` if set (checked against `dtype`), else `select_implementation` for this process's devices
    and packages, or XLA's path for a `dtype` the flash kernels do not take (float32)."""
    named = named_implementation(None, dtype)
    if named:
        return named
    return _auto() if _flash_takes(dtype) else "reference"


def named_implementation(attention: str | None, dtype: DTypeLike | None = None) -> str | None:
    """The path named for a tower of `dtype`: `attention`, else `$VITJAX_ATTENTION`, checked (a ValueError names
    the setting); None where neither names one. Cheap: encoders call it before they load any weights."""
    if attention:
        return check_implementation(attention, dtype)
    chosen = os.environ.get(ENV_VAR)
    return check_implementation(chosen, dtype, f"${ENV_VAR}") if chosen else None


def bucket_implementation(impl: str, segments: int, automatic: bool) -> str:
    """The path a bucket of `segments` slots runs: `impl`, except that the automatic fa4 choice leaves buckets past
    `FA4_MAX_SEGMENTS` slots to cudnn_packed where JAX's entry point for it is usable. A path named by the caller
    (or `$VITJAX_ATTENTION`) runs in every bucket."""
    if automatic and impl == "fa4" and segments > FA4_MAX_SEGMENTS and _packed_entry() is not None:
        return "cudnn_packed"
    return impl


def value_columns(impl: str, head_dim: int) -> tuple[float, ...]:
    """The columns `impl` wants appended to every head of v (the same in every row), or (): for fa4 at a head dim its
    tile pads under a `value_sums` schedule (72 in a tile of 80), a one (the softmax's row sums ride in that column
    of P·V) and zeros up to the tile's width. The output still comes back at `head_dim` (`_output_width`). v's
    columns are the projection weights' to make: zero weights, these as bias."""
    tile = fa4.FA4_TILES.get(head_dim)
    if impl != "fa4" or tile is None or not tile.value_sums or fa4.fa4_tile_width(head_dim) == head_dim:
        return ()
    return (1.0,) + (0.0,) * (fa4.fa4_tile_width(head_dim) - head_dim - 1)


def query_key_columns(
    impl: str, head_dim: int, dtype: DTypeLike = jnp.bfloat16
) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """How `impl` wants q and k of a tower in `dtype`: q multiplied by a factor, then the columns appended to every head
    of q and of k. For fa4 under a `shift_column` schedule (towers that hold the fixed shift) q in log2 units
    (head_dim**-0.5 · log2(e), applied before q's one rounding) with zeros up to the tile's width, k with a one and
    zeros: the kernel writes each row's shift into q's first spare column. (1.0, (), ()) where q and k go as they
    are."""
    tile = fa4.FA4_TILES.get(head_dim)
    columns = value_columns(impl, head_dim)
    if not columns or not tile.shift_column or not fa4.holds_fixed_shift(dtype):
        return 1.0, (), ()
    return head_dim**-0.5 / fa4.LN2, (0.0,) * len(columns), columns


def widen(x: jax.Array, columns: tuple[float, ...]) -> jax.Array:
    """x `[..., width]` with `columns` appended to every row: v `[T, heads, head_dim]` as `value_columns` wants it
    (a copy, for checks and benchmarks; the tower's v GEMM writes them itself, from v's bias widened this way)."""
    if not columns:
        return x
    appended = jnp.broadcast_to(jnp.asarray(columns, x.dtype), (*x.shape[:-1], len(columns)))
    return jnp.concatenate([x, appended], axis=-1)


def cudnn_packed_available() -> bool:
    """True on Hopper-or-newer GPUs with a JAX release the packed path was verified on."""
    gpu = jax.default_backend() == "gpu"
    return gpu and select_implementation("gpu", _capabilities(), None, _packed_entry() is not None) == "cudnn_packed"


def fa4_available() -> bool:
    """True on Hopper GPUs with a verified fa4-jax installed."""
    gpu = jax.default_backend() == "gpu"
    return gpu and select_implementation("gpu", _capabilities(), fa4.fa4_version(), False) == "fa4"


def check_implementation(impl: str, dtype: DTypeLike | None = None, setting: str = "attention") -> str:
    """`impl` if it can run here on towers of `dtype` (any, when None), else a ValueError naming `setting`."""
    if impl not in IMPLEMENTATIONS:
        where = "" if setting == "attention" else f"{setting}: "
        raise ValueError(f"{where}unknown attention implementation {impl!r}; choose one of {IMPLEMENTATIONS}")
    if impl != "reference" and not _flash_takes(dtype):
        raise ValueError(
            f"{setting} {impl!r} takes {' or '.join(FLASH_DTYPES)} towers, not {jnp.dtype(dtype).name}; "
            "use 'reference' (XLA) or leave the choice to vitjax"
        )
    if impl == "cudnn_packed" and _packed_entry() is None:
        raise ValueError(f"cudnn_packed needs JAX {' or '.join(CUDNN_PACKED_VERIFIED)} (found {jax.__version__})")
    if impl == "fa4" and fa4.fa4_version() is None:
        raise ValueError("attention 'fa4' needs the fa4-jax package: pip install 'vitjax[fa4]'")
    return impl


def check_devices(impl: str | None, devices: Sequence[jax.Device], setting: str = "attention") -> None:
    """Refuse a named flash path (fa4, cuDNN's) for devices that are not all CUDA GPUs, where its kernels cannot
    run, before any weight is read."""
    if impl in GPU_ONLY and any(d.platform != "gpu" for d in devices):
        platforms = ", ".join(sorted({d.platform for d in devices}))
        raise ValueError(
            f"{setting} {impl!r} runs on CUDA GPUs only, not on {platforms} devices; use 'reference' or "
            "leave the choice to vitjax"
        )


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: Segments, impl: str = "reference", head_dim: int | None = None
) -> jax.Array:
    """Block-diagonal softmax attention, scale head_dim**-0.5; returns `[T, heads, head_dim]` in q's dtype. v is
    `[T, heads, head_dim]`, or wider by `value_columns(impl, head_dim)`, which fa4's kernel then relies on (the other
    paths leave the appended columns out); q and k likewise as they are or as `query_key_columns(impl, head_dim)`
    makes them, `head_dim` then naming their width before (None: q's width).

    With `segments.seq_axis`, q, k and v are this device's tokens of all heads: one all-to-all trades them for
    all tokens of this device's heads, the kernel runs on those, and a second all-to-all trades back (Ulysses;
    q, k and v travel together since a small exchange costs its latency more than its bytes; a wider v apart).
    """
    if segments.seq_axis is not None:
        axis = segments.seq_axis

        def trade(x: jax.Array) -> jax.Array:
            return jax.lax.all_to_all(x, axis, split_axis=x.ndim - 2, concat_axis=x.ndim - 3, tiled=True)

        local = dataclasses.replace(segments, seq_axis=None)
        if v.shape == q.shape:
            out = attention(*trade(jnp.stack([q, k, v])), local, impl, head_dim)
        else:
            out = attention(*trade(jnp.stack([q, k])), trade(v), local, impl, head_dim)
        return jax.lax.all_to_all(out, axis, split_axis=0, concat_axis=1, tiled=True)
    if impl == "fa4":
        return fa4.forward(q, k, v, segments, head_dim or q.shape[-1])
    if head_dim not in (None, q.shape[-1]):
        raise ValueError(f"attention {impl!r} takes q and k at head_dim {head_dim}, not widened to {q.shape[-1]}")
    v = v[..., : q.shape[-1]]
    if impl == "cudnn_packed":
        return _cudnn_packed(q, k, v, segments)
    if impl == "cudnn_padded":
        return padded_batch(q, k, v, segments, "cudnn")
    if impl == "reference":
        return _reference(q, k, v, segments)
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLEMENTATIONS}")


def _cudnn_packed(q: jax.Array, k: jax.Array, v: jax.Array, segments: Segments) -> jax.Array:
    """cuDNN's ragged layout: one batch row, M segments given by offsets (M+1, the last = T) and lengths.

    Unused slots (offset T, length 0) are what cuDNN expects of empty segments. With one slot the only
    frame starts at 0 and a plain padding mask says the same (JAX treats one segment as unpacked).
    """
    dot_product_attention, mask_type = _packed_entry()
    tokens = q.shape[0]
    packed = {}
    if segments.starts.shape[0] > 1:
        offsets = jnp.concatenate([segments.starts, jnp.full((1,), tokens, jnp.int32)])[None]
        packed = {"q_offsets": offsets, "kv_offsets": offsets}
    lengths = segments.lengths[None] if packed else segments.lengths
    out = dot_product_attention(
        q[None],
        k[None],
        v[None],
        q_seqlen=lengths,
        kv_seqlen=lengths,
        scale=q.shape[-1] ** -0.5,
        mask_type=mask_type.PADDING,
        **packed,
    )
    return out[0]


def padded_batch(q: jax.Array, k: jax.Array, v: jax.Array, segments: Segments, implementation: str) -> jax.Array:
    """Gather segments into `[M, L, heads, head_dim]`, run the public API with per-row lengths, gather back.

    `implementation` is passed to `jax.nn.dot_product_attention` ("cudnn" on GPUs; "xla" lets CPU tests
    check the gathers).
    """
    tokens = q.shape[0]
    length = segments.max_length or tokens
    offset = jnp.arange(length, dtype=jnp.int32)
    rows = jnp.where(offset < segments.lengths[:, None], segments.starts[:, None] + offset, tokens)

    def gather(x: jax.Array) -> jax.Array:
        return jnp.take(x, rows, axis=0, mode="fill", fill_value=0)

    out = jax.nn.dot_product_attention(
        gather(q),
        gather(k),
        gather(v),
        scale=q.shape[-1] ** -0.5,
        query_seq_lengths=segments.lengths,
        key_value_seq_lengths=segments.lengths,
        implementation=implementation,
    )
    seg = jnp.maximum(segments.ids, 0)
    back = seg * length + jnp.arange(tokens, dtype=jnp.int32) - segments.starts[seg]
    back = jnp.where(segments.ids >= 0, back, out.shape[0] * length)
    return jnp.take(out.reshape(-1, *v.shape[1:]), back, axis=0, mode="fill", fill_value=0)


def _reference(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: Segments, block: int = 512, chunk: int = 1024
) -> jax.Array:
    """Portable XLA version: fp32 scores, a block of queries at a time against the keys of its own frames only,
    a chunk of keys at a time with the softmax carried over chunks as the flash kernels carry it. Scoring every key
    of the call instead would cost a call of many small frames its length squared (`bench/NOTES.md`).

    A non-finite value of v stays in its own segment, as in the kernels and HF's per-frame attention: P.V runs on v
    with it zeroed, and the output is NaN where a key of the query's own segment had one. Padding rows get zeros.
    """
    tokens, heads, dim = q.shape
    blocks = -(-tokens // block)
    chunks = 1 if tokens <= 2 * chunk else -(-tokens // chunk)  # a small call is one chunk: no loop to compile
    block, chunk = -(-tokens // blocks), -(-tokens // chunks)  # evened out: 2,560 tokens are 3 chunks of 854
    ids = segments.ids

    def rows(x: jax.Array, n: int, fill: int = 0) -> jax.Array:
        return jnp.pad(x, ((0, n - tokens),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)

    qb = rows(q, blocks * block).reshape(blocks, block, heads, dim)
    ib = rows(ids, blocks * block, -1).reshape(blocks, block)
    bad = ~jnp.isfinite(v)
    kc, vc, ic = rows(k, chunks * chunk), rows(jnp.where(bad, 0, v), chunks * chunk), rows(ids, chunks * chunk, -1)
    ends = segments.starts + segments.lengths
    precision = jax.lax.Precision.HIGHEST

    def one_block(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        qi, si = args
        real = si >= 0
        seg = jnp.maximum(si, 0)
        first = jnp.min(jnp.where(real, segments.starts[seg], tokens)) // chunk
        last = -(-jnp.max(jnp.where(real, ends[seg], 0)) // chunk)

        def step(carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            c, top, total, acc = carry
            kj, vj, ij = (jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk) for x in (kc, vc, ic))
            same = (real[:, None] & (si[:, None] == ij[None, :]))[None]
            s = jnp.einsum("qhd,khd->hqk", qi, kj, preferred_element_type=jnp.float32, precision=precision)
            s = jnp.where(same, s * dim**-0.5, -jnp.inf)
            new_top = jnp.maximum(top, s.max(-1))
            shift = jnp.where(new_top == -jnp.inf, 0, new_top)  # no key of the row yet: p and keep are 0
            p = jnp.exp(s - shift[..., None])
            keep = jnp.exp(top - shift)
            pv = jnp.einsum(
                "hqk,khd->hqd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32, precision=precision
            )
            return c + 1, new_top, total * keep + p.sum(-1), acc * keep[..., None] + pv

        zeros = jnp.zeros_like(qi[..., 0], jnp.float32).T  # like qi, so as varying as it inside shard_map
        acc = jnp.broadcast_to(zeros[..., None], (heads, block, v.shape[-1]))
        start = (first, zeros - jnp.inf, zeros, acc)
        if chunks == 1:  # every key at once, as a block of padding alone gets zeros either way
            _, _, total, acc = step((0, *start[1:]))
        else:
            _, _, total, acc = jax.lax.while_loop(lambda carry: carry[0] < last, step, start)
        return (acc / jnp.where(total > 0, total, 1)[..., None]).transpose(1, 0, 2)

    out = jax.lax.map(one_block, (qb, ib)).reshape(blocks * block, heads, v.shape[-1])[:tokens]
    poisoned = jax.ops.segment_max(bad.astype(jnp.int8), ids, num_segments=segments.starts.shape[0]) > 0
    hit = (ids >= 0)[:, None, None] & poisoned[jnp.maximum(ids, 0)]
    return jnp.where(hit, jnp.nan, out).astype(q.dtype)
