"""fa4's Hopper forward with four MMA warpgroups: 256 query rows per thread block.

At head_dim 72 the kernel is bound by each warpgroup's Q·Kᵀ → softmax → P·V chain while three warpgroups take
turns on the tensor cores (bench/NOTES.md, "P·V at width 72"): tensor pipes ~60% busy, nothing saturated. A
fourth warpgroup gives the turn-taking one more chain to hide a softmax under, and each K/V tile read from L2
serves 256 rows instead of 192. fa4-jax 0.1.0 allows 1–3 MMA warpgroups (FA3's register split 160/32 fills the
register file at 3). `setmaxnreg` only moves registers between the warps of a block, out of what the launch gave
it: 640 threads launch with 96 each (61,440), so four warpgroups get `CONSUMER_REGS` each with the producer at 24
(asking for more waits forever). Exact edits to fa4-jax's own source
(`WIDE_VERIFIED`), as `fa4_persistent` did: the limits on the warpgroup count, the register split, and the
turn-taking barrier of the fourth warpgroup.
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

# fa4-jax releases whose `cute/flash_fwd_sm90.py` these edits were written against.
WIDE_VERIFIED = ("0.1.0",)
CONSUMER_REGS = 112  # 4 × 128 × 112 + 128 × 24 = 60,416 of the 640 × 96 = 61,440 the launch gives


def edits(consumer_regs: int) -> tuple[tuple[str, str, int], ...]:
    """(fa4-jax's text, ours, how often it occurs). Indentation is part of the text."""
    return (
        (
            "        if tile_m % 64 != 0 or tile_m // 64 not in (1, 2, 3):\n",
            "        if tile_m % 64 != 0 or tile_m // 64 not in (1, 2, 3, 4):\n",
            1,
        ),
        ("        assert self.num_wg_mma in [1, 2, 3]\n", "        assert self.num_wg_mma in [1, 2, 3, 4]\n", 1),
        (
            "{1: (256, 56), 2: (240, 24), 3: (160, 32)}[",
            f"{{1: (256, 56), 2: (240, 24), 3: (160, 32), 4: ({consumer_regs}, 24)}}[",
            1,
        ),
        ("            assert self.num_wg_mma in [2, 3]\n", "            assert self.num_wg_mma in [2, 3, 4]\n", 1),
    )


def edited_source(source: str, consumer_regs: int) -> str:
    """fa4's SM90 forward with the edits applied; refuses a source any edit does not match exactly. The fourth
    warpgroup's turn barrier is WarpSchedulerWG1 + 3, the id of `PFull`, which the SM90 forward never uses."""
    if "PFull" in source or "PEmpty" in source:
        raise RuntimeError("fa4-jax's Hopper forward uses the P barriers the fourth warpgroup's turn would take")
    for old, new, count in edits(consumer_regs):
        found = source.count(old)
        if found != count:
            first = old.strip().splitlines()[0]
            raise RuntimeError(
                f"fa4-jax's Hopper forward is not the one the four-warpgroup edits were written for "
                f"({WIDE_VERIFIED}): {first!r} occurs {found} times, expected {count}"
            )
        source = source.replace(old, new)
    return source


@functools.cache
def wide_forward_class(consumer_regs: int = CONSUMER_REGS) -> type:
    """`FlashAttentionForwardSm90` from the edited source. The CuTe DSL reads its kernels' source back, so the
    module is written to a file (atomically, named by its hash) and imported."""
    found = importlib.metadata.version("fa4-jax")
    if found not in WIDE_VERIFIED:
        raise RuntimeError(f"fa4 with four warpgroups is verified with fa4-jax {WIDE_VERIFIED} (found {found})")
    from fa4_jax.cute import flash_fwd_sm90

    source = edited_source(inspect.getsource(flash_fwd_sm90), consumer_regs)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"vitjax-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"fa4_sm90_wide_{digest}.py"
    if not path.exists():
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(source)
        os.replace(partial, path)
    name = f"vitjax_fa4_sm90_wide_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.FlashAttentionForwardSm90
