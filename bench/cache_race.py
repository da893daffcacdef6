"""Two processes writing one entry of JAX's persistent compilation cache at once, as SGLang's ranks do when they
compile the same bucket as they start: how often the entry is left corrupt, with JAX's default (no size bound, so
no lock, each entry written in place), with a size bound (JAX then locks the cache's files; a folder that unlocked
writes filled refuses new entries then, bench/NOTES.md) and with vitjax's `whole_cache_writes` (each entry written to
a file of its own and renamed onto its place).

    python bench/cache_race.py [--trials 60]   # CPU only; prints one line per mode

The two values stand for two processes' executables of one key, which differ (XLA's autotuning differs between
processes) and here differ in size, the case an unlocked interleaving leaves corrupt.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
from pathlib import Path

from jax._src.lru_cache import LRUCache  # the class JAX's cache uses (checked on JAX 0.10.2 and 0.11.2)

from vitjax.engine import whole_cache_writes

KEY = "bucket"


def write(folder: str, value: bytes, max_size: int, whole: bool, start: mp.synchronize.Barrier) -> None:
    if whole:
        whole_cache_writes()
    cache = LRUCache(folder, max_size=max_size)
    start.wait()
    cache.put(KEY, value)


def corrupt_entries(max_size: int, whole: bool, trials: int) -> int:
    """Trials whose entry is neither process's value."""
    a, b = b"A" * (24 << 20), b"B" * (20 << 20)
    bad = 0
    for _ in range(trials):
        folder = tempfile.mkdtemp(prefix="vitjax-cache-race-")
        start = mp.Barrier(2)
        procs = [mp.Process(target=write, args=(folder, v, max_size, whole, start)) for v in (a, b)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        bad += (Path(folder) / f"{KEY}-cache").read_bytes() not in (a, b)
        shutil.rmtree(folder)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=60)
    args = ap.parse_args()
    modes = {
        "unbounded, unlocked (JAX's default)": (-1, False),
        "bounded (1 TiB), locked": (1 << 40, False),
        "unbounded, written whole (vitjax's)": (-1, True),
    }
    for name, (max_size, whole) in modes.items():
        print(f"{name}: {corrupt_entries(max_size, whole, args.trials)} of {args.trials} entries corrupt", flush=True)


if __name__ == "__main__":
    main()
