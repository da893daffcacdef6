"""fa4's Hopper forward with persistent thread blocks: one block per SM walks the packed sequence's row blocks.

fa4-jax 0.1.0 launches one thread block per (row block, head) of the packed sequence (`SingleTileVarlenScheduler`,
"TODO: dispatch to DynamicPersistentVarlenScheduler"). With ~170 KiB of shared memory a block holds its SM alone,
so between two blocks the SM waits for the launch, the first Q and K loads and the epilogue's O store. Its kernel
already loops over work tiles (the producer waits on Q's empty barrier and loads the next tile's Q and K while the
consumers finish the last one, as FA3's persistent C++ does); what keeps it single-tile is the scheduler, and the O
tile staged over Q's buffer, which the next tile's Q load would overwrite. Here, as exact edits to fa4-jax's own
source (`PERSISTENT_VERIFIED`): O gets a buffer of its own, and a scheduler walks the tiles blockIdx.x, + gridDim.x,
... over a grid of one block per SM (the varlen decoder orders the valid tiles first, so a block stops at its first
invalid one).
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
PERSISTENT_VERIFIED = ("0.1.0",)

SCHEDULER = '''

class PersistentVarlenScheduler(SingleTileVarlenScheduler):
    """vitjax: `ctas` thread blocks, each walking the tiles blockIdx.x, + gridDim.x, ..."""

    ctas = 132

    @staticmethod
    def create(params, ctx=None, *, loc=None, ip=None):
        tile_idx, split_idx, _ = cute.arch.block_idx()
        return PersistentVarlenScheduler(params, tile_idx, split_idx, loc=loc, ip=ip)

    @staticmethod
    def get_grid_shape(params, *, loc=None, ip=None):
        tiles, splits, _ = SingleTileVarlenScheduler.get_grid_shape(params)
        return (cutlass.min(tiles, PersistentVarlenScheduler.ctas), splits, Int32(1))

    def advance_to_next_work(self, *, loc=None, ip=None):
        self._tile_idx += cute.arch.grid_dim()[0]
        return self.get_current_work()
'''

# (fa4-jax's text, ours, how often it occurs). Indentation is part of the text.
EDITS: tuple[tuple[str, str, int], ...] = (
    (
        "        sP_struct = cute.struct.Align[cute.struct.MemRange[self.dtype, cosize_sP], 1024]\n",
        "        sP_struct = cute.struct.Align[cute.struct.MemRange[self.dtype, cosize_sP], 1024]\n"
        "        sO_struct = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sO_layout)], 1024]\n",
        1,
    ),
    (
        "            sP: sP_struct\n\n        @cute.struct\n        class SharedStorageSharedQV:\n",
        "            sP: sP_struct\n            sO: sO_struct\n\n"
        "        @cute.struct\n        class SharedStorageSharedQV:\n",
        1,
    ),
    ("        sO_base = storage.sQ if const_expr(sO_fits_sQ) else storage.sV\n", "        sO_base = storage.sO\n", 1),
    (
        "            TileScheduler = SingleTileVarlenScheduler\n",
        "            TileScheduler = PersistentVarlenScheduler\n",
        1,
    ),
)


def edited_source(source: str) -> str:
    """fa4's SM90 forward with `EDITS` applied and the scheduler appended; refuses a source any edit does not
    match exactly."""
    for old, new, count in EDITS:
        found = source.count(old)
        if found != count:
            first = old.strip().splitlines()[0]
            raise RuntimeError(
                f"fa4-jax's Hopper forward is not the one the persistent edits were written for "
                f"({PERSISTENT_VERIFIED}): {first!r} occurs {found} times, expected {count}"
            )
        source = source.replace(old, new)
    return source + SCHEDULER


def o_tile_bytes(tile_m: int, head_dim: int) -> int:
    """Shared memory the O tile's own buffer takes (bf16, head_dim padded to 16, 1 KiB aligned)."""
    return -(-tile_m * -(-head_dim // 16) * 16 * 2 // 1024) * 1024


@functools.cache
def persistent_forward_class(ctas: int) -> type:
    """`FlashAttentionForwardSm90` from the edited source, launching `ctas` thread blocks. The CuTe DSL reads its
    kernels' source back, so the module is written to a file (atomically, named by its hash) and imported."""
    found = importlib.metadata.version("fa4-jax")
    if found not in PERSISTENT_VERIFIED:
        raise RuntimeError(f"fa4 persistent blocks are verified with fa4-jax {PERSISTENT_VERIFIED} (found {found})")
    from fa4_jax.cute import flash_fwd_sm90

    source = edited_source(inspect.getsource(flash_fwd_sm90))
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"vitjax-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"fa4_sm90_persistent_{digest}.py"
    if not path.exists():
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(source)
        os.replace(partial, path)
    name = f"vitjax_fa4_sm90_persistent_{digest}_{ctas}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    module.PersistentVarlenScheduler.ctas = ctas
    return module.FlashAttentionForwardSm90
