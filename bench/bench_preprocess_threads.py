"""Why `Encoder.encode`'s preprocessing stopped scaling with threads: the host side alone, per variant and per step.

The pipeline's work on N distinct 960x1280 JPEGs (`bench_encode.jpegs`): `Pipeline.prepare` (decode, hash, size)
then `Batch.add` (rows as uint8 levels into one batch buffer), as `Encoder.encode` drives it, in 1..32 worker
threads. Each variant runs in a process of its own (an allocator setting is made at start):

- `shipped`: the pipeline as it is;
- `asarray`: an image's pixels copied out by `np.asarray` (Pillow's `tobytes`, which holds Python's lock) for its
  digest and its rows, and resized even to its own size, as before 2026-11-28 (`bench_encode.old_resized_pixels`),
  rather than viewed in place (`vitjax.pil_pixels`);
- `top_pad`: glibc keeps up to 64 MiB free at each arena's top (`MALLOC_TOP_PAD_`, as `mallopt(M_TOP_PAD)`, which also
  fixes its mmap threshold): a worker thread's freed memory otherwise goes back to the kernel, and the next image
  faults its pages in again, zeroed;
- `reuse`: the batch buffer (32 MB or more: glibc maps and unmaps it each time) is allocated once and reused;
- `top_pad+reuse`: both.

Per variant, workers and N: the median wall time of 5 runs (after one untimed), and that run's process CPU time
(user, system) and minor page faults. `--stages` instead times each step of one image alone in 1..32 threads
(decode, Pillow's `tobytes`, `np.asarray` of an image, the in-place view packed for hashing, sha256 of a contiguous
copy, `preprocess_image` of an array: `Image.fromarray`, the view, the rows): which steps scale with threads.
One JSON object per line, appended to <out>/<device>-<date>.jsonl.

    PYTHONPATH=. python bench/bench_preprocess_threads.py --out bench/results [--stages]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_encode import jpegs, pixels_copied  # noqa: E402
from bench_vit import PRESET, results_file, versions  # noqa: E402

import vitjax  # noqa: E402
from vitjax.images import load_image  # noqa: E402
from vitjax.pil_pixels import rgb_bytes  # noqa: E402
from vitjax.pipeline import Batch, Pipeline  # noqa: E402
from vitjax.preprocess import LEVELS, MAX_PIXELS, MIN_PIXELS, preprocess_image  # noqa: E402

VARIANTS = {
    "shipped": {},
    "asarray": {},
    "top_pad": {"MALLOC_TOP_PAD_": str(64 << 20)},
    "reuse": {},
    "top_pad+reuse": {"MALLOC_TOP_PAD_": str(64 << 20)},
}


def measure(variant: str, counts: list[int], workers: list[int]) -> list[dict]:
    """This process's rows for `variant` (its allocator already set by the parent)."""
    cfg = vitjax.VisionConfig.preset(PRESET)
    if variant == "asarray":
        pixels_copied(True)
    rows = []
    for n in counts:
        data = [(f"{k}.jpg", b) for k, b in enumerate(jpegs(n))]
        kept: dict[int, np.ndarray] = {}
        for w in workers:
            with Pipeline(cfg, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, pixel_dtype=LEVELS, workers=w) as pipe:

                def batch(size: int, host: bool | None = None, pipe=pipe, kept=kept) -> Batch:
                    if "reuse" not in variant:
                        return Pipeline.batch(pipe, size, host)
                    if size not in kept:
                        kept[size] = np.empty((size, cfg.patch_dim), LEVELS)
                    return Batch(pipe, size, kept[size])

                pipe.batch = batch

                # as `Encoder.encode` drives it: each item added once prepared
                def run(pipe=pipe, n=n, data=data) -> None:
                    batch = pipe.batch(n * (960 // cfg.patch_size) * (1280 // cfg.patch_size))
                    for item in pipe.prepare(data):
                        batch.add(item)
                    batch.finish()

                run()
                samples = []
                for _ in range(5):
                    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                    run()
                    samples.append((time.perf_counter() - start, before, resource.getrusage(resource.RUSAGE_SELF)))
                samples.sort(key=lambda s: s[0])
                wall, before, after = samples[len(samples) // 2]
                rows.append(
                    {
                        "variant": variant,
                        "images": n,
                        "workers": w,
                        "ms": wall * 1e3,
                        "ms_all": [round(s[0] * 1e3, 2) for s in samples],
                        "user_s": after.ru_utime - before.ru_utime,
                        "sys_s": after.ru_stime - before.ru_stime,
                        "minor_faults": after.ru_minflt - before.ru_minflt,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def stages(workers: list[int]) -> list[dict]:
    """Each step of one image's preprocessing alone, on 8 photos round-robin, 64 a thread count: ms an image."""
    data = jpegs(8)
    images = [load_image(b, "photo") for b in data]
    arrays = [np.asarray(image) for image in images]
    outs = [np.empty((a.shape[0] * a.shape[1] // 256, 1536), LEVELS) for a in arrays]
    steps = {
        "decode": lambda k: load_image(data[k], "photo"),
        "tobytes": lambda k: images[k].tobytes(),
        "asarray": lambda k: np.asarray(images[k]),
        "rgb_bytes": lambda k: rgb_bytes(images[k]),
        "sha256": lambda k: hashlib.sha256(arrays[k]).hexdigest(),
        "rows_from_array": lambda k: preprocess_image(arrays[k], out=outs[k]),
    }
    rows = []
    for step, work in steps.items():
        for w in workers:
            with ThreadPoolExecutor(w) as pool:
                list(pool.map(work, [k % 8 for k in range(16)]))
                start = time.perf_counter()
                list(pool.map(work, [k % 8 for k in range(64)]))
                rows.append({"step": step, "workers": w, "ms_an_image": (time.perf_counter() - start) / 64 * 1e3})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, in this order")
    parser.add_argument("--images", default="20,64", help="comma-separated numbers of JPEGs")
    parser.add_argument("--workers", default="1,8,16,32", help="comma-separated thread counts (capped at the cores)")
    parser.add_argument("--stages", action="store_true", help="time each preprocessing step alone instead")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a variant, measured in this process
    args = parser.parse_args()
    counts = [int(n) for n in args.images.split(",")]
    cores = os.cpu_count() or 1
    workers = sorted({min(int(w), cores) for w in args.workers.split(",")})
    if args.child:
        print(json.dumps(measure(args.child, counts, workers)))
        return
    meta = versions()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    host = {"host_cores": cores, "transparent_hugepages": thp.read_text().strip() if thp.exists() else None}
    if args.stages:
        rows = [{**meta, **host, "bench": "preprocess_stages", **r} for r in stages(workers)]
        args.out.mkdir(parents=True, exist_ok=True)
        with results_file(args.out, meta).open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return
    rows = []
    for variant in args.variants.split(","):
        env = {**os.environ, **VARIANTS[variant]}
        argv = [sys.executable, __file__, "--child", variant, "--images", args.images, "--workers", args.workers]
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        sys.stderr.write(done.stderr)
        done.check_returncode()
        rows += [{**meta, **host, "bench": "preprocess_threads", **r} for r in json.loads(done.stdout.splitlines()[-1])]
    args.out.mkdir(parents=True, exist_ok=True)
    with results_file(args.out, meta).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{'variant':14} {'images':>6} {'workers':>7} {'ms':>8} {'user s':>7} {'sys s':>7} {'faults':>8}")
    for r in rows:
        print(
            f"{r['variant']:14} {r['images']:6} {r['workers']:7} {r['ms']:8.1f} {r['user_s']:7.3f} {r['sys_s']:7.3f} "
            f"{r['minor_faults']:8}"
        )


if __name__ == "__main__":
    main()
