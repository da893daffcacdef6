"""Compile fa4's Hopper forward for sm_90a on a machine without a GPU, and read what the compiler made of it.

The CuTe DSL traces, lowers and assembles a kernel without a driver once it is told the target, so candidate
schedules (`vitjax.fa4.Fa4Tile`) can be checked for spills and register headroom before any device time is
spent. Each schedule is the kernel object vitjax would launch (`fa4._fa4_sm90_forward`), called as vitjax
calls it (packed sequence, 16 heads, `cu_seqlens` and used lengths, bf16). Reported: shared memory, the highest
register the SASS uses (the consumer warpgroups get 160 registers with 3 of them, 240 with 2), local-memory
spills (STL/LDL) and wgmma instructions.

Python >= 3.12 with `pip install -e ".[fa4]"`, `pip install --no-deps jax-tvm-ffi==0.1.3` and, for the SASS,
`pip install nvidia-cuda-nvdisasm`:

    python bench/fa4_offline.py 192x144ss 128x176rs [--head-dim 72]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HEADS = 16


def nvdisasm() -> str | None:
    """nvdisasm from the PATH or the nvidia-cuda-nvdisasm wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        for path in Path(root).glob("*/bin/nvdisasm"):
            return str(path)
    return None


def compile_schedule(text: str, head_dim: int) -> dict:
    """Trace and compile one schedule (the cubin lands in $CUTE_DSL_DUMP_DIR)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from fa4_jax.cute.utils import AuxData

    from vitjax.fa4 import Fa4Tile, _fa4_sm90_forward, fa4_tile_width

    tile = Fa4Tile.parse(text)
    width_v = fa4_tile_width(head_dim) if tile.value_sums else head_dim  # V as the tower gives it (`value_columns`)
    width = width_v if tile.shift_column else head_dim  # q and k likewise (`query_key_columns`)
    kernel = _fa4_sm90_forward(tile, cutlass.BFloat16, head_dim, width_v, 1, False, width)
    storage = kernel._get_shared_storage_cls
    row = {"schedule": str(tile)}

    def measured_storage():
        cls = storage()
        row["shared_bytes"] = int(cls.size_in_bytes())
        return cls

    kernel._get_shared_storage_cls = measured_storage

    @cute.jit
    def forward(stream, q, k, v, cu, used, out):
        kernel(
            q,
            k,
            v,
            out,
            None,
            head_dim**-0.5,
            mCuSeqlensQ=cu,
            mCuSeqlensK=cu,
            mSeqUsedQ=used,
            mSeqUsedK=used,
            window_size_left=None,
            window_size_right=None,
            aux_data=AuxData(),
            stream=stream,
        )

    def rows(columns: int = width):
        shape = (cute.sym_int32(), HEADS, columns)
        return make_fake_compact_tensor(cutlass.BFloat16, shape, stride_order=(2, 1, 0), assumed_align=256)

    def ints():
        return make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(),), stride_order=(0,), assumed_align=256)

    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    tensors = (rows(), rows(), rows(width_v), ints(), ints(), rows(head_dim))  # O at head_dim (`fa4.forward`)
    cute.compile(forward, stream, *tensors, options="--enable-tvm-ffi")
    return row


def read_sass(cubin: Path) -> dict:
    tool = nvdisasm()
    if tool is None:
        return {"sass": "nvdisasm not found"}
    sass = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    registers = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
    return {
        "highest_register": max(registers, default=None),
        "spill_stores": len(re.findall(r"\bSTL\b", sass)),
        "spill_loads": len(re.findall(r"\bLDL\b", sass)),
        "wgmma": len(re.findall(r"\bHGMMA\.", sass)),
        "mufu_ex2": len(re.findall(r"\bMUFU\.EX2\b", sass)),
        "instructions": len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("schedules", nargs="+", help="fa4 tiles, e.g. 192x144ss 128x176rs3")
    ap.add_argument("--head-dim", type=int, default=72)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the per-schedule worker
    args = ap.parse_args()
    if args.one:  # in its own process: the DSL reads its settings once, at import
        print(json.dumps(compile_schedule(args.schedules[0], args.head_dim)))
        return
    print(
        f"{'schedule':<20}{'shared KiB':>11}{'highest reg':>12}{'spills st/ld':>13}{'wgmma':>7}{'ex2':>6}{'instr':>7}"
    )
    for text in args.schedules:
        with tempfile.TemporaryDirectory() as dump:
            env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": dump}
            env.update(CUTE_DSL_NO_CACHE="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), *sys.path]))
            cmd = [sys.executable, __file__, text, "--head-dim", str(args.head_dim), "--one"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                print(f"{text:<20} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}")
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            cubins = sorted(Path(dump).rglob("*.cubin"))
            row.update(read_sass(cubins[0]) if cubins else {"sass": "no cubin kept"})
        spills = f"{row.get('spill_stores', '-')}/{row.get('spill_loads', '-')}"
        print(
            f"{row['schedule']:<20}{row['shared_bytes'] / 1024:>11.1f}{row.get('highest_register', '-'):>12}"
            f"{spills:>13}{row.get('wgmma', '-'):>7}{row.get('mufu_ex2', '-'):>6}{row.get('instructions', '-'):>7}"
        )


if __name__ == "__main__":
    main()
