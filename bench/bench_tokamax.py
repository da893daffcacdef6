"""Experiment: tokamax's Mosaic GPU flash attention (per-row k_start/k_end = block-diagonal mask) against
vitjax's cuDNN packed path, on packed Qwen3-VL frames (16 heads, head_dim 72 and 64, bf16, forward).

Not a vitjax dependency: run it with tokamax (Python >= 3.12) and its imports on PYTHONPATH, e.g. wheels
installed with `pip install --no-deps --target /tmp/site tokamax qwix immutabledict einshape pydantic ...`:

    PYTHONPATH=/tmp/site:. python bench/bench_tokamax.py
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import timed  # bench/ is on sys.path when run as a script

from vitjax import attention, layout

TOKENS = 98304
CASES = {"20x4800": [(1, 60, 80)] * 20, "96x1024": [(1, 32, 32)] * 96}
# (block_q, block_kv, num_stages, persistent): tokamax's heuristic for this mask first, then its SM90 tuning space.
CONFIGS = [
    None,
    (128, 128, 2, True),
    (128, 64, 2, True),
    (64, 128, 3, True),
    (128, 128, 3, True),
    (64, 256, 2, True),
    (128, 128, 2, False),
]


def main() -> None:
    from tokamax._src.ops.attention import base
    from tokamax._src.ops.attention.pallas_mosaic_gpu import PallasMosaicGpuFlashAttention
    from tokamax._src.ops.attention.pallas_mosaic_gpu_kernel_sm90 import Config

    for head_dim in (72, 64):
        for name, grids in CASES.items():
            packed = layout.pack(grids, TOKENS, 128)
            seg = attention.Segments(*(jnp.asarray(a) for a in packed[3:]))
            ids = packed.segment_ids
            real = ids >= 0
            k_start = np.where(real, packed.segment_starts[np.maximum(ids, 0)], 0).astype(np.int32)
            k_end = np.where(real, k_start + packed.segment_lengths[np.maximum(ids, 0)], 1).astype(np.int32)
            mask = base.Mask(k_start=jnp.asarray(k_start), k_end=jnp.asarray(k_end))
            keys = jax.random.split(jax.random.key(head_dim), 3)
            q, k, v = (jax.random.normal(key, (TOKENS, 16, head_dim), jnp.bfloat16) for key in keys)
            flops = 4 * 16 * head_dim * sum((h * w) ** 2 for _, h, w in grids)
            cudnn = jax.jit(lambda q, k, v, seg=seg: attention.attention(q, k, v, seg, "cudnn_packed"))
            row = {"case": name, "head_dim": head_dim}
            ref = cudnn(q, k, v)
            t = timed(cudnn, q, k, v)
            row.update(cudnn_ms=t * 1e3, cudnn_tflops=flops / t / 1e12)
            print(json.dumps(row), flush=True)
            for cfg in CONFIGS if (head_dim, name) == (72, "20x4800") else CONFIGS[:1]:
                config = (
                    None
                    if cfg is None
                    else Config(block_q=cfg[0], block_kv=cfg[1], num_stages=cfg[2], persistent=cfg[3])
                )
                op = PallasMosaicGpuFlashAttention(config=config)
                row = {"case": name, "head_dim": head_dim, "config": cfg or "heuristic"}
                try:
                    fn = jax.jit(lambda q, k, v, mask=mask, op=op: op(q[None], k[None], v[None], mask=mask)[0])
                    out = fn(q, k, v)
                    t = timed(fn, q, k, v)
                    err = float(jnp.abs(out[real] - ref[real]).astype(jnp.float32).max())
                    row.update(tokamax_ms=t * 1e3, tokamax_tflops=flops / t / 1e12, max_abs_diff_vs_cudnn=err)
                except Exception as e:  # an experiment: report and go on
                    row["tokamax_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
