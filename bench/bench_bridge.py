"""The bridge's tower adapter on CUDA: time per call and memory of JAX and torch sharing one GPU.

`bridge.JaxVisionTower` over a random 8B-config encoder (bf16) on cuda:0, called as SGLang calls it. Device
pixel rows (a CUDA torch tensor) are cut into bucket chunks on the device (`Engine._device_pieces`: row views
and one executable per chunk size since 2026-11-23; before, a program compiled per input row count). So per
new row count (its bucket already compiled by the host call): host call 1 and 2, then device call 1 (new row
count) and 2. Then the memory peak of each framework (torch: `max_memory_allocated`; JAX:
`memory_stats()['peak_bytes_in_use']`).

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python bench/bench_bridge.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vit import PRESET, results_file, versions  # noqa: E402

import bridge  # noqa: E402
import vitjax  # noqa: E402

# Row counts within one bucket (3584 tokens) after 720p's 3520, then a small photo in another bucket.
GRIDS = [(1, 44, 80), (1, 44, 78), (1, 42, 80), (1, 40, 84), (1, 32, 24)]


def timed(tower: bridge.JaxVisionTower, pixels: torch.Tensor, grid: tuple[int, int, int]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    tower(pixels, torch.tensor([grid]))  # returns once the features are ready
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    cuda = torch.device("cuda", 0)
    tower = bridge.JaxVisionTower(config=vitjax.VisionConfig.preset(PRESET), device=cuda, dtype=torch.bfloat16)
    tower.encoder = vitjax.Encoder.random(PRESET, devices=[bridge.tower.jax_device(cuda)], cache_bytes=0)
    meta = versions()
    rows = []
    for grid in GRIDS:
        n = grid[0] * grid[1] * grid[2]
        pixels = torch.randn(n, tower.encoder.cfg.patch_dim, device=cuda).to(torch.bfloat16)
        host = pixels.cpu()
        ms = [timed(tower, p, grid) * 1e3 for p in (host, host, pixels, pixels, pixels)]
        row = {"bench": "bridge", **meta, "grid": grid, "rows": n, "host_ms": ms[:2], "device_ms": ms[2:]}
        rows.append(row)
        print(
            f"{str(grid):14} host call 1/2 {ms[0]:8.1f} {ms[1]:7.1f} ms | device call 1/2/3 "
            f"{ms[2]:7.1f} {ms[3]:7.1f} {ms[4]:7.1f} ms"
        )
    stats = jax.devices("gpu")[0].memory_stats()
    memory = {
        "bench": "bridge-memory",
        **meta,
        "torch_peak_gib": torch.cuda.max_memory_allocated(cuda) / 2**30,
        "jax_peak_gib": stats["peak_bytes_in_use"] / 2**30,
        "jax_in_use_gib": stats["bytes_in_use"] / 2**30,
        "gpu_used_gib": (torch.cuda.mem_get_info(cuda)[1] - torch.cuda.mem_get_info(cuda)[0]) / 2**30,
    }
    rows.append(memory)
    print(json.dumps(memory))
    args.out.mkdir(parents=True, exist_ok=True)
    path = results_file(args.out, meta)
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
