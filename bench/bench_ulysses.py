"""What Ulysses sequence parallelism pays for its all-to-alls, on the GPUs of one host.

The tower's own exchange (`jax.lax.all_to_all` of one block's q, k or v, `[tokens/n, 16, 72]` bf16 per
device, heads for tokens) timed alone at the 1x720p and 20x960x1280 bucket sizes, beside a plain
device-to-device copy of the same bytes and PyTorch's view of peer access; then one 8B tower call on one
device and split over two (Ulysses), its parts timed apart. One JSON object per line.

    PYTHONPATH=. python bench/bench_ulysses.py
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import pipelined_ms  # bench/ is on sys.path when run as a script
from bench_vit import versions
from jax.sharding import Mesh, NamedSharding, PartitionSpec

HEADS, HEAD_DIM = 16, 72


def emit(**row) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def main() -> None:
    emit(**versions(), devices=len(jax.devices()))
    try:
        import torch

        n = torch.cuda.device_count()
        emit(bench="peer_access", torch=[[torch.cuda.can_device_access_peer(a, b) for b in range(n)] for a in range(n)])
    except ImportError:
        pass
    devices = jax.devices()
    if len(devices) < 2:
        emit(error="needs two devices")
        return
    n = len(devices)
    mesh = Mesh(np.array(devices), ("seq",))
    split = NamedSharding(mesh, PartitionSpec("seq"))
    for tokens in (3584, 98304):
        x = jax.device_put(jnp.ones((tokens, HEADS, HEAD_DIM), jnp.bfloat16), split)
        exchange = jax.jit(
            jax.shard_map(
                lambda a: jax.lax.all_to_all(a, "seq", split_axis=1, concat_axis=0, tiled=True),
                mesh=mesh,
                in_specs=PartitionSpec("seq"),
                out_specs=PartitionSpec(None, "seq"),
            )
        )
        ms = pipelined_ms(exchange, x)
        moved = x.nbytes * (n - 1) / n  # bytes that leave their device, all devices together
        emit(bench="all_to_all", tokens=tokens, mb_per_device=x.nbytes / n / 2**20, ms=ms, gb_s=moved / ms / 1e6)
        local = jax.device_put(jnp.ones((tokens * HEADS * HEAD_DIM // n,), jnp.bfloat16), devices[0])
        ms = pipelined_ms(lambda a: jax.device_put(a, devices[1]), local)
        emit(bench="device_put_0_to_1", tokens=tokens, ms=ms, gb_s=local.nbytes / ms / 1e6)


def tower(devices: int, sequence_parallel: int, grids, impl: str | None = None) -> None:
    """One bucket call of the 8B tower (random bf16 weights), its parts timed apart."""
    import vitjax
    from vitjax import layout

    cfg = vitjax.VisionConfig.preset("qwen3-vl-8b")
    enc = vitjax.Encoder.random(cfg, devices=devices, sequence_parallel=sequence_parallel, attention=impl)
    engine = enc.parallel.engines[0]
    (bucket, _), *_ = engine.policy.plan(grids)
    tokens = sum(layout.grid_tokens(g) for g in grids)
    pixels = np.random.default_rng(0).standard_normal((tokens, cfg.patch_dim), dtype=np.float32)
    exe = engine.executable(bucket, np.float32, engine._max_length(bucket, max(h * w for _, h, w in grids)))
    args = engine._inputs(pixels, 0, tokens, grids, bucket)
    row = {"bench": "tower", "devices": devices, "sequence_parallel": sequence_parallel, "tokens": bucket.tokens}
    row["attention"] = enc.attention
    row["inputs_ms"] = pipelined_ms(lambda: engine._inputs(pixels, 0, tokens, grids, bucket), reps=10)
    row["executable_ms"] = pipelined_ms(lambda: exe(engine._state, *args), reps=10)
    row["encode_patches_ms"] = pipelined_ms(lambda: enc.encode_patches(pixels, np.array(grids)), reps=5)
    emit(**row)


def towers() -> None:
    for grids in ([(1, 44, 80)], [(1, 80, 60)] * 20):
        for devices, sp, impl in ((1, 1, None), (2, 2, None), (2, 2, "cudnn_padded")):
            tower(devices, sp, grids, impl)


if __name__ == "__main__":
    main()
    towers()
