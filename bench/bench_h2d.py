"""Host pixel rows to the GPU: the copy `encode_patches` pays before the tower when pixels come from numpy.

20 x 960x1280 is 96,000 rows of 1,536 float32 (590 MB), ~22 ms of the 20-photo call at the ~24 GB/s of pageable
copies. Each way is timed end to end (host array in, device array ready), rounds rotating, median ms and GB/s:
- `chunks`: what `Engine._inputs` does, one `device_put` of a list of 2,048-row views;
- `whole`: one `device_put` of the whole array;
- `chunks_threads`: the chunks put from 8 host threads;
- `pinned`: the chunks put into pinned host memory, then to the device (two `device_put`s);
- `pinned_chunkwise`: the same chunk by chunk (each chunk's copy to the device queued behind its pinning);
- `pinned_threads`: chunk by chunk from 8 host threads;
- `pinned_dma`: the second half of `pinned` alone (pixels already pinned);
- `bf16_cast`, `bf16_chunks`: casting to bfloat16 on the host, and sending the cast rows as chunks;
- `torch_pageable`, `torch_pin`, `torch_pinned_dma`: PyTorch's `.to("cuda")` from pageable memory, pinning
  included, and from memory pinned ahead.

`--devices N` (N > 1) asks instead whether the copies of a data-parallel request overlap: each of N devices gets
1/N of the rows, as `DataParallel.encode` gives each engine its share. Ways (`n1_*`: device 0's share alone, the
others from N host threads at once, `serial`: the N shares from one thread in a row):
`n1_chunks` / `parallel_chunks` / `serial_chunks` (as `Engine._inputs` sends them), `parallel_bf16_chunks`,
`parallel_pinned_dma` (shares pinned ahead), `n1_torch_pageable` / `parallel_torch_pageable`.

    PYTHONPATH=. python bench/bench_h2d.py --out bench/results [--devices 4]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import ml_dtypes
import numpy as np
import torch
from bench_attention import recorder, rotating_rounds  # bench/ is on sys.path when run as a script

CHUNK = 2048
WORKLOADS = {"20x960x1280": 96000, "8x1080p": 65280, "1x720p": 3520}


def chunks(x: np.ndarray) -> list[np.ndarray]:
    return [x[i : i + CHUNK] for i in range(0, len(x), CHUNK)]


def ways(x: np.ndarray, device: jax.Device, pool: ThreadPoolExecutor) -> dict:
    """name -> a function that copies x to the device and returns once it is there."""
    on_device = jax.sharding.SingleDeviceSharding(device)
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    parts = chunks(x)
    held = jax.block_until_ready(jax.device_put(parts, pinned))
    x_bf16 = x.astype(ml_dtypes.bfloat16)
    t = torch.from_numpy(x)
    t_pinned = t.pin_memory()

    def torch_ready(y: torch.Tensor) -> None:
        torch.cuda.synchronize()

    return {
        "chunks": lambda: jax.block_until_ready(jax.device_put(parts, device)),
        "whole": lambda: jax.block_until_ready(jax.device_put(x, device)),
        "chunks_threads": lambda: jax.block_until_ready(list(pool.map(lambda c: jax.device_put(c, device), parts))),
        "pinned": lambda: jax.block_until_ready(jax.device_put(jax.device_put(parts, pinned), on_device)),
        "pinned_chunkwise": lambda: jax.block_until_ready(
            [jax.device_put(jax.device_put(c, pinned), on_device) for c in parts]
        ),
        "pinned_threads": lambda: jax.block_until_ready(
            list(pool.map(lambda c: jax.device_put(jax.device_put(c, pinned), on_device), parts))
        ),
        "pinned_dma": lambda: jax.block_until_ready(jax.device_put(held, on_device)),
        "bf16_cast": lambda: x.astype(ml_dtypes.bfloat16),
        "bf16_chunks": lambda: jax.block_until_ready(jax.device_put(chunks(x_bf16), device)),
        "torch_pageable": lambda: torch_ready(t.to("cuda")),
        "torch_pin": lambda: torch_ready(t.pin_memory().to("cuda", non_blocking=True)),
        "torch_pinned_dma": lambda: torch_ready(t_pinned.to("cuda", non_blocking=True)),
    }


def parallel_ways(x: np.ndarray, devices: list[jax.Device], pool: ThreadPoolExecutor) -> dict:
    """name -> a function that copies each device's share of x's rows to it and returns once all are there."""
    shares = [chunks(s) for s in np.array_split(x, len(devices))]
    bf16 = [chunks(s) for s in np.array_split(x.astype(ml_dtypes.bfloat16), len(devices))]
    pinned = [jax.sharding.SingleDeviceSharding(d, memory_kind="pinned_host") for d in devices]
    held = [jax.block_until_ready(jax.device_put(s, p)) for s, p in zip(shares, pinned, strict=True)]
    tensors = [torch.from_numpy(s) for s in np.array_split(x, len(devices))]
    pairs = list(zip(shares, devices, strict=True))
    on_device = [jax.sharding.SingleDeviceSharding(d) for d in devices]  # a pinned array needs the memory kind
    bf16_pairs, held_pairs = list(zip(bf16, devices, strict=True)), list(zip(held, on_device, strict=True))
    torch_pairs = list(zip(tensors, range(len(devices)), strict=True))

    def each(work, items) -> None:
        jax.block_until_ready(list(pool.map(lambda item: work(*item), items)))
        for i in range(len(devices)):
            torch.cuda.synchronize(i)

    return {
        "n1_chunks": lambda: jax.block_until_ready(jax.device_put(shares[0], devices[0])),
        "parallel_chunks": lambda: each(jax.device_put, pairs),
        "serial_chunks": lambda: jax.block_until_ready([jax.device_put(s, d) for s, d in pairs]),
        "parallel_bf16_chunks": lambda: each(jax.device_put, bf16_pairs),
        "parallel_pinned_dma": lambda: each(jax.device_put, held_pairs),
        "n1_torch_pageable": lambda: each(lambda t, i: t.to(f"cuda:{i}"), [(tensors[0], 0)]),
        "parallel_torch_pageable": lambda: each(lambda t, i: t.to(f"cuda:{i}"), torch_pairs),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--devices", type=int, default=1, help="N > 1: the shares of N data-parallel devices")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    _, emit = recorder("bench_h2d", args.out)
    devices = jax.devices()[: args.devices]
    pool = ThreadPoolExecutor(max(8, args.devices))
    for workload, rows in WORKLOADS.items():
        x = np.random.default_rng(0).standard_normal((rows, 1536), np.float32)
        fns = ways(x, devices[0], pool) if args.devices == 1 else parallel_ways(x, devices, pool)
        for fn in fns.values():
            fn()  # first use: allocators, pinned pools
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _, name in rotating_rounds(list(fns), args.rounds):
            start = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
        for name, ms in times.items():
            med = float(np.median(ms))
            nbytes = x.nbytes // 2 if "bf16_chunks" in name else x.nbytes
            nbytes //= args.devices if name.startswith("n1_") else 1
            emit(
                {
                    "bench": "h2d",
                    "workload": workload,
                    "devices": args.devices,
                    "way": name,
                    "ms": round(med, 3),
                    "gb_per_s": round(nbytes / med / 1e6, 2),
                    "ms_all": [round(v, 3) for v in ms],
                }
            )


if __name__ == "__main__":
    main()
