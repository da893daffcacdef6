"""Two GPUs, one compile per program: a data-parallel encoder's engines share each bucket's compilation through
JAX's persistent cache (the second engine loads what the first compiled, its executable gives the first's results).

Skipped without two NVIDIA GPUs. Each case runs in a fresh process with an empty cache directory of its own (the
tests' conftest turns the cache off, and JAX reads its cache settings once per process):

    JAX_PLATFORMS=cuda python -m pytest -m gpu tests/test_gpu_parallel.py -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        os.environ.get("JAX_PLATFORMS", "") == "cpu" or jax.default_backend() != "gpu" or len(jax.devices()) < 2,
        reason="needs two NVIDIA GPUs (JAX_PLATFORMS=cuda)",
    ),
]

BUCKETS = [(512, 1), (1024, 4), (2048, 1)]


def child() -> None:
    """Warm a 2-GPU encoder's buckets from an empty cache, counting JAX's cache hits and misses; then encode one
    image on each GPU. Prints one JSON line."""
    import numpy as np
    from jax import monitoring

    import vitjax
    from vitjax import buckets

    counts = {"hits": 0, "misses": 0}
    names = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}

    def listen(event: str, **_) -> None:
        if event in names:
            counts[names[event]] += 1

    monitoring.register_event_listener(listen)
    buckets.CACHE_MIN_COMPILE_SECONDS = 0  # the tiny tower's programs compile fast: keep them all
    cfg = vitjax.VisionConfig(
        depth=4, hidden_size=144, num_heads=2, intermediate_size=80, out_hidden_size=48, deepstack_visual_indexes=(1, 2)
    )
    policy = buckets.BucketPolicy(tokens=(512, 1024, 2048), segments=(1, 4))
    enc = vitjax.Encoder.random(cfg, devices=2, buckets=policy)
    before = dict(counts)
    enc.warmup([buckets.Bucket(*b) for b in BUCKETS], run=False)
    warmup = {k: counts[k] - before[k] for k in counts}
    compiles = [e.compiles for e in enc.parallel.engines]
    grid = (1, 16, 20)  # 320 patches: the 512-token bucket, one image on each GPU
    image = np.random.default_rng(0).standard_normal((320, cfg.patch_dim), dtype=np.float32)
    pixels = np.concatenate([image, image])
    first, second = enc.encode_patches(pixels, np.array([grid, grid]))
    result = {
        "warmup": warmup,
        "compiles": compiles,
        "devices": [d.id for o in (first, second) for d in o.devices()],
        "equal": bool(np.array_equal(np.asarray(first, np.float32), np.asarray(second, np.float32))),
        "cache_files": sum(len(files) for _, _, files in os.walk(os.environ["VITJAX_CACHE_DIR"])),
    }
    print("RESULT " + json.dumps(result), flush=True)


def test_two_gpus_compile_each_bucket_once(tmp_path):
    env = {**os.environ, "VITJAX_CACHE_DIR": str(tmp_path / "xla"), "JAX_PLATFORMS": "cuda"}
    proc = subprocess.run(
        [sys.executable, __file__, "child"], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-4000:]
    result = json.loads(line[7:])
    print(result)
    # one compile per bucket (the first engine's), one load from the cache per bucket (the second's)
    assert result["warmup"] == {"hits": len(BUCKETS), "misses": len(BUCKETS)}
    assert result["compiles"] == [len(BUCKETS), len(BUCKETS)]
    assert result["devices"] == [0, 1]
    assert result["equal"]  # the loaded executable computes what the compiled one does


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    child()
