"""Peak host memory of `vitjax encode` on a folder of large photos: it must not grow with the number of images.

Writes N distinct 4000x3000 JPEGs (12 MP, 36 MB each once decoded; `bench_encode.jpegs`) to a folder, then
runs `vitjax encode FOLDER --random-init qwen3-vl-2b` in a fresh process per N and reads that process's peak
resident set size from the kernel (`os.wait4`'s rusage). The images are resized to a few thousand pixels
(`--max-pixels`) so the CPU tower stays quick: what is measured is the host side (decode, resize, buffers),
whose peak `Encoder.encode` bounds by its decode-ahead window, not by the number of images.

    python bench/bench_memory.py                     # N = 1, 10, 60; appends to bench/results/cpu-DATE.jsonl
    python bench/bench_memory.py --code /other/clone  # the same, running another checkout's vitjax
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_encode import jpegs  # noqa: E402
from bench_vit import versions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def peak_rss(argv: list[str], code: Path) -> tuple[int, float, int]:
    """(peak RSS in bytes, seconds, exit status) of `vitjax` run with `argv` from the checkout `code`."""
    env = {**os.environ, "PYTHONPATH": str(code), "JAX_PLATFORMS": "cpu"}
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "vitjax.cli", *argv], cwd=code, env=env)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024, time.perf_counter() - started, child.returncode  # ru_maxrss is in KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,10,60", help="numbers of photos, comma separated")
    parser.add_argument("--max-pixels", type=int, default=4096)
    parser.add_argument("--code", type=Path, default=ROOT, help="checkout whose vitjax runs (default: this one)")
    parser.add_argument("--photos", type=Path, help="folder to keep the generated JPEGs in (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="JSON lines file (default: bench/results/cpu-DATE.jsonl)")
    args = parser.parse_args()
    counts = [int(n) for n in args.counts.split(",")]
    meta = versions()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.code, capture_output=True, text=True)
    store = args.photos or Path(tempfile.mkdtemp(prefix="vitjax-photos-"))
    store.mkdir(parents=True, exist_ok=True)
    missing = [k for k in range(max(counts)) if not (store / f"{k:03d}.jpg").exists()]
    if missing:
        for k, data in enumerate(jpegs(max(counts), (4000, 3000))):
            (store / f"{k:03d}.jpg").write_bytes(data)
    out = args.out or ROOT / "bench" / "results" / f"cpu-{meta['date']}.jsonl"
    for n in counts:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "photos"
            folder.mkdir()
            for k in range(n):
                (folder / f"{k:03d}.jpg").symlink_to(store / f"{k:03d}.jpg")
            argv = ["encode", str(folder), "--random-init", "qwen3-vl-2b", "-o", f"{tmp}/e.safetensors"]
            argv += ["--min-pixels", str(args.max_pixels), "--max-pixels", str(args.max_pixels)]
            rss, seconds, status = peak_rss(argv, args.code)
        row = {
            **meta,
            "bench": "memory",
            "workload": f"{n}x4000x3000 jpeg, qwen3-vl-2b random, max_pixels {args.max_pixels}",
            "images": n,
            "peak_rss_mb": round(rss / 2**20, 1),
            "seconds": round(seconds, 1),
            "exit_status": status,
            "cpus": os.cpu_count(),
            "code": rev.stdout.strip() or str(args.code),
        }
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
