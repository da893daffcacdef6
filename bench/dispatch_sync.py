"""Does a tower call's dispatch wait for the GPU? `Engine.run` on device-resident pixels (8B tower, random bf16
weights, fa4): the time until it returns and until the outputs are ready, median of 7 calls, per variant of the
program, each a fresh encoder. Variants: `shipped`; `unguarded` (fa4's fixed shift without its overflow check, the
`while_loop` XLA runs from the host; not exact on overflow); `graphs_while` (XLA's command buffers given the loop and
conditional commands, "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"); `graphs_while_dsf` (the same
plus DYNAMIC_SLICE_FUSION); `min_graph_1` (`xla_gpu_graph_min_graph_size` 1). With `HLO_DIR` the shipped 20-photo
program's optimized HLO is written there and its while loops listed.

    PYTHONPATH=.:bench python bench/dispatch_sync.py [VARIANT...] --out bench/results
"""

from __future__ import annotations

import argparse
import os
import re
import time

import jax
import numpy as np
from bench_attention import recorder  # bench/ is on sys.path when run as a script

import vitjax
from vitjax import fa4

WORKLOADS = {"20x960x1280": [(1, 60, 80)] * 20, "8x720p": [(1, 44, 80)] * 8, "1x720p": [(1, 44, 80)]}


def measure(variant: str, enc: vitjax.Encoder, hlo_dir: str | None, emit) -> None:
    engine = enc.parallel.engines[0]
    for name, grids in WORKLOADS.items():
        rows = sum(t * h * w for t, h, w in grids)
        pixels = jax.device_put(np.random.default_rng(0).standard_normal((rows, 1536), np.float32))
        for _ in range(3):
            jax.block_until_ready([c.output for c in engine.run(pixels, grids)])
            engine.settle()
        dispatch, wall = [], []
        for _ in range(7):
            start = time.perf_counter()
            calls = engine.run(pixels, grids)
            dispatch.append((time.perf_counter() - start) * 1e3)
            jax.block_until_ready([c.output for c in calls])
            wall.append((time.perf_counter() - start) * 1e3)
        row = {
            "variant": variant,
            "workload": name,
            "dispatch_ms": float(np.median(dispatch)),
            "wall_ms": float(np.median(wall)),
            "dispatch_all": [round(d, 2) for d in dispatch],
        }
        if hlo_dir and variant == "shipped" and name == "20x960x1280":
            for _key, exe in list(engine._executables.items())[-1:]:
                text = exe.as_text()
                whiles = re.findall(r"^.*\bwhile\(.*$", text, re.M)
                row["whiles"] = [w.strip()[:160] for w in whiles]
                row["command_buffers"] = len(re.findall(r"command_buffer", text))
                with open(os.path.join(hlo_dir, f"{variant}-{name}.hlo.txt"), "w") as f:
                    f.write(text)
        emit(row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="*", default=["shipped", "unguarded", "graphs_while", "shipped_again"])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    _, emit = recorder("dispatch_sync", args.out)
    hlo_dir = os.environ.get("HLO_DIR")
    variants = args.variants
    options = dict(vitjax.engine.COMPILER_OPTIONS)
    guarded = fa4.forward
    for variant in variants:
        vitjax.engine.COMPILER_OPTIONS.clear()
        vitjax.engine.COMPILER_OPTIONS.update(options)
        fa4.forward = guarded
        if variant == "min_graph_1":
            vitjax.engine.COMPILER_OPTIONS["xla_gpu_graph_min_graph_size"] = 1
        if variant == "graphs_while":
            vitjax.engine.COMPILER_OPTIONS["xla_gpu_enable_command_buffer"] = (
                "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
            )
        if variant == "graphs_while_dsf":
            vitjax.engine.COMPILER_OPTIONS["xla_gpu_enable_command_buffer"] = (
                "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION"
            )
        if variant == "unguarded":  # the fixed shift without its overflow check (not exact on overflow)
            src = guarded

            def unguarded(q, k, v, segments, head_dim, src=src):
                real = jax.lax.while_loop
                jax.lax.while_loop = lambda cond, body, init: init
                try:
                    return src(q, k, v, segments, head_dim)
                finally:
                    jax.lax.while_loop = real

            fa4.forward = unguarded
        enc = vitjax.Encoder.random("qwen3-vl-8b", attention="fa4")
        measure(variant, enc, hlo_dir, emit)
        del enc


if __name__ == "__main__":
    main()
