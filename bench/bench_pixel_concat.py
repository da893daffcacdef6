"""The tower's first pass: a call's pixel chunks concatenated and cast to the weights' dtype (one GPU).

A bucket executable takes its pixels as 2,048-row chunks (`vitjax.engine`) and concatenates them before the patch
embedding. On an H200 XLA fused the 47 float32 chunks of the 20-photo call and their cast to bf16 into one loop
fusion that moved its 885 MB at ~1.2 TB/s (0.71 ms). Here the patch embedding alone, compiled with the bucket
options, in forms that compute the same values: `concat_then_cast` (shipped), `cast_then_concat` (each chunk cast
before the concatenation), `embed_per_chunk` (the GEMM per chunk, its outputs concatenated). Rotating rounds,
device time per op from the profiler. One JSON object per line.

    PYTHONPATH=. python bench/bench_pixel_concat.py --out bench/results
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import recorder, rotating_rounds  # bench/ is on sys.path when run as a script
from bench_vit import op_times

from vitjax.engine import COMPILER_OPTIONS

FORMS = {
    "concat_then_cast": lambda chunks, w: jnp.concatenate(chunks).astype(w.dtype) @ w,
    "cast_then_concat": lambda chunks, w: jnp.concatenate([c.astype(w.dtype) for c in chunks]) @ w,
    "embed_per_chunk": lambda chunks, w: jnp.concatenate([c.astype(w.dtype) @ w for c in chunks]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=47, help="2,048-row chunks (47: the 20 photos' fitted bucket)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    _, emit = recorder("bench_pixel_concat", args.out)
    rng = np.random.default_rng(0)
    chunks = tuple(jax.device_put(rng.standard_normal((2048, 1536), np.float32)) for _ in range(args.chunks))
    w = jax.device_put(rng.standard_normal((1536, 1152), np.float32) / 40).astype(jnp.bfloat16)
    options = COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
    compiled = {name: jax.jit(f).lower(chunks, w).compile(compiler_options=options) for name, f in FORMS.items()}
    want = np.asarray(compiled["concat_then_cast"](chunks, w), np.float32)
    for name, exe in compiled.items():
        got = np.asarray(exe(chunks, w), np.float32)
        assert np.array_equal(got, want) or name == "embed_per_chunk", name  # the per-chunk GEMMs may round apart
    times = {name: [] for name in FORMS}
    for _, name in rotating_rounds(list(FORMS), args.rounds):
        ops = op_times(lambda exe=compiled[name]: jax.block_until_ready(exe(chunks, w)))
        times[name].append(({op: ms for _, op, ms in ops}, sum(ms for _, _, ms in ops)))
    for name, runs in times.items():
        emit(
            {
                "bench": "pixel_concat",
                "form": name,
                "chunks": args.chunks,
                "device_ms": float(np.median([total for _, total in runs])),
                "ops_ms": {op: float(np.median([r[0].get(op, 0.0) for r in runs])) for op in runs[0][0]},
            }
        )


if __name__ == "__main__":
    main()
