"""fa4's Hopper forward with K/V shared by a pair of thread blocks (TMA multicast over a 2-CTA cluster).

At head_dim 72 fa4's Hopper forward is bound by L2 bandwidth: every block of query rows streams its whole
sequence's K and V from L2 (bench/NOTES.md, issue 12). Two blocks of adjacent rows of one sequence and head read
the same K/V tiles, so here they run as one cluster: each loads half of every K/V tile and multicasts it into
both blocks' shared memory, halving the L2 reads. fa4-jax 0.1.0 launches 1x1 clusters with the multicast left as
a TODO; its kernel already has the cluster barrier setup, and its varlen scheduler already hands each block of a pair
its own row block (`cluster_shape_mn`). What is missing is a handful of lines, made here as exact edits to fa4-jax's
own source, each checked to match before anything is built (`FA4_MULTICAST_VERIFIED`).

A sequence with an odd number of row blocks gets a partner past its end: it loads and releases every K/V tile
with its peer (or the cluster's barriers would wait forever) and writes nothing, since the ragged TMA store of O
and the row-guarded LSE store drop rows past the sequence.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import tempfile
from pathlib import Path

# fa4-jax releases whose `cute/flash_fwd_sm90.py` these edits were written against and run on a GPU.
FA4_MULTICAST_VERIFIED = ("0.1.0",)

# (fa4-jax's text, ours, how often it occurs). Indentation is part of the text.
EDITS: tuple[tuple[str, str, int], ...] = (
    ("        self.cluster_shape_mn = (1, 1)\n", "        self.cluster_shape_mn = (2, 1)\n", 1),
    (
        "cpasync.CopyBulkTensorTileG2SOp()  # Might multicast",
        "cpasync.CopyBulkTensorTileG2SMulticastOp()",
        1,
    ),
    ("                1,  # No mcast for now\n", "                2,  # multicast to the pair\n", 2),
    (
        "            lpt=self.is_causal or self.is_local,\n",
        "            lpt=self.is_causal or self.is_local,\n            cluster_shape_mn=self.cluster_shape_mn,\n",
        1,
    ),
    (
        "            min_blocks_per_mp=1,\n        )\n",
        "            min_blocks_per_mp=1,\n            cluster=[2, 1, 1],\n        )\n",
        1,
    ),
    # Each K/V stage is free once the consumer warps of both blocks released it: lane 0 of a warp signals block
    # 0, lane 1 block 1 (`mcast_mode_mn=(0, 1)`: shared by the blocks that differ in M).
    (
        "        mma_warps = ThreadCooperativeGroup(self.num_mma_threads // cute.arch.WARP_SIZE)\n",
        "        mma_warps = ThreadCooperativeGroup(self.num_mma_threads // cute.arch.WARP_SIZE)\n"
        "        mma_warps_pair = ThreadCooperativeGroup(2 * self.num_mma_threads // cute.arch.WARP_SIZE)\n",
        1,
    ),
    *(
        (
            f'                consumer_group=mma_warps,\n                tx_count=self.tma_copy_bytes["{x}"],\n',
            f'                consumer_group=mma_warps_pair,\n                tx_count=self.tma_copy_bytes["{x}"],\n'
            "                cta_layout_vmnk=cute.make_layout((1, 2, 1, 1)),\n"
            "                mcast_mode_mn=(0, 1),\n",
            1,
        )
        for x in "KV"
    ),
    (
        "        tidx, _, _ = cute.arch.thread_idx()\n\n        # TMA: only warp 0 loads.",
        "        tidx, _, _ = cute.arch.thread_idx()\n"
        "        pair_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())\n\n"
        "        # TMA: only warp 0 loads.",
        1,
    ),
    *(
        (
            f"                        tma_atom_{x}, 0, cute.make_layout(1), g{x}, s{x}\n",
            f"                        tma_atom_{x}, pair_rank, cute.make_layout(2), g{x}, s{x},"
            " mcast_mask=cutlass.Int16(3)\n",
            1,
        )
        for x in "KV"
    ),
    # The peer's last releases of K land on this block's barriers too: wait for them before exiting.
    (
        "                pipeline_v.producer_tail(kv_producer_state)\n",
        "                pipeline_k.producer_tail(kv_producer_state.clone())\n"
        "                pipeline_v.producer_tail(kv_producer_state)\n",
        1,
    ),
)


def edited_source(source: str) -> str:
    """fa4's SM90 forward with `EDITS` applied; refuses a source any edit does not match exactly."""
    for old, new, count in EDITS:
        found = source.count(old)
        if found != count:
            first = old.strip().splitlines()[0]
            raise RuntimeError(
                f"fa4-jax's Hopper forward is not the one the K/V multicast was written for "
                f"({FA4_MULTICAST_VERIFIED}): {first!r} occurs {found} times, expected {count}"
            )
        source = source.replace(old, new)
    return source


@functools.cache
def multicast_forward_class() -> type:
    """`FlashAttentionForwardSm90` from the edited source. The CuTe DSL reads its kernels' source back, so the
    module is written to a file (atomically, named by its hash) and imported from there."""
    found = importlib.metadata.version("fa4-jax")
    if found not in FA4_MULTICAST_VERIFIED:
        raise RuntimeError(f"fa4 K/V multicast is verified with fa4-jax {FA4_MULTICAST_VERIFIED} (found {found})")
    from fa4_jax.cute import flash_fwd_sm90

    source = edited_source(inspect.getsource(flash_fwd_sm90))
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"vitjax-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"fa4_sm90_multicast_{digest}.py"
    if not path.exists():
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(source)
        os.replace(partial, path)
    name = f"vitjax_fa4_sm90_multicast_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.FlashAttentionForwardSm90
