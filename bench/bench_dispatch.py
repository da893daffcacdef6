"""What the host spends to start one small tower call, under XLA's command-buffer settings (one GPU).

A 1 x 720p call on device-resident pixels takes ~13 ms on the wall for ~11 ms of device work; the host's part
(`Engine.run` until it returns) is ~2 ms, most of it in launching the bucket executable. Here the 8B tower (random
bf16 weights, fa4) is compiled for the 720p bucket under several XLA command-buffer settings, each in a fresh
engine, and per setting: the launch alone (the executable called on prepared arguments, then waited for), the
launch when the pixel rows are a new array each call (as in serving), `Engine.run`'s dispatch and wall time, and the
device busy time; then a trivial program with as many arguments, for the runtime's own cost per launch. Rotating
rounds, medians. One JSON object per line.

    PYTHONPATH=. python bench/bench_dispatch.py --out bench/results
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import recorder, rotating_rounds  # bench/ is on sys.path when run as a script
from bench_vit import RESOLUTIONS, op_times

import vitjax

# XLA's command buffers (CUDA graphs): as shipped, off, and without the loop and conditional commands (the scan is
# then a host loop over graphs of its body).
SETTINGS = {
    "shipped": {},
    "no_command_buffers": {"xla_gpu_enable_command_buffer": ""},
    "no_while_in_graphs": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"},
}


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a tiny config, to check the script on a CPU")
    args = ap.parse_args()
    _, emit = recorder("bench_dispatch", args.out)
    enc = vitjax.Encoder.random(vitjax.VisionConfig(2, 144, 2, 80, 48, (0,)) if args.smoke else "qwen3-vl-8b")
    grids = [RESOLUTIONS["720p"]]
    rows = sum(t * h * w for t, h, w in grids)
    rng = np.random.default_rng(0)
    pixels = jax.device_put(rng.standard_normal((rows, enc.cfg.patch_dim), np.float32))
    shipped_options = dict(vitjax.engine.COMPILER_OPTIONS)
    built = {}
    for name, extra in SETTINGS.items():
        vitjax.engine.COMPILER_OPTIONS = {**shipped_options, **extra}
        try:
            engine = vitjax.engine.Engine(enc.cfg, enc._graph, enc._state, enc.attention)
            ((bucket, _),) = engine.policy.plan(grids)
            exe = engine.executable(bucket, np.float32)
            call_args = (engine._state, *engine._inputs(pixels, 0, rows, grids, bucket))
            jax.block_until_ready(exe(*call_args))
            built[name] = (engine, exe, call_args, bucket)
        except Exception as e:  # a setting the installed XLA rejects is reported, not fatal
            emit({"bench": "dispatch", "setting": name, "error": repr(e)[:300]})
        finally:
            vitjax.engine.COMPILER_OPTIONS = shipped_options
    results = {name: {k: [] for k in ("launch", "launch_new_rows", "dispatch", "wall")} for name in built}
    for _, name in rotating_rounds(list(built), args.rounds):
        engine, exe, call_args, bucket = built[name]
        got = results[name]

        def launch(exe=exe, call_args=call_args):
            jax.block_until_ready(exe(*call_args))

        def launch_new_rows(engine=engine, exe=exe, bucket=bucket):
            fresh = engine._inputs(pixels + 0, 0, rows, grids, bucket)  # new buffers, as a new request has
            jax.block_until_ready(fresh)
            start = time.perf_counter()
            jax.block_until_ready(exe(engine._state, *fresh))
            return time.perf_counter() - start

        got["launch"].append(median_ms(launch, 20))
        got["launch_new_rows"].append(float(np.median([launch_new_rows() for _ in range(20)])) * 1e3)
        dispatch, wall = [], []
        for _ in range(20):
            start = time.perf_counter()
            outputs = [c.output for c in engine.run(pixels, grids)]
            dispatch.append(time.perf_counter() - start)
            jax.block_until_ready(outputs)
            wall.append(time.perf_counter() - start)
        got["dispatch"].append(float(np.median(dispatch)) * 1e3)
        got["wall"].append(float(np.median(wall)) * 1e3)
    for name, (_, exe, call_args, _) in built.items():
        ops = op_times(lambda exe=exe, call_args=call_args: exe(*call_args))
        emit(
            {
                "bench": "dispatch",
                "workload": "1x720p",
                "setting": name,
                "options": SETTINGS[name],
                **{f"{k}_ms": float(np.median(v)) for k, v in results[name].items()},
                **{f"{k}_ms_rounds": [round(x, 3) for x in v] for k, v in results[name].items()},
                "device_busy_ms": sum(ms for _, _, ms in ops),
            }
        )
    # The runtime's own cost: a trivial program over as many device arguments as the tower's executable takes.
    leaves = jax.tree.leaves(next(iter(built.values()))[2])
    trivial = jax.jit(lambda *xs: xs[0][:1] + 1).lower(*leaves).compile()
    small = [jnp.zeros(1) for _ in leaves]
    trivial_small = jax.jit(lambda *xs: xs[0] + 1).lower(*small).compile()
    emit(
        {
            "bench": "dispatch",
            "setting": "trivial_program",
            "arguments": len(leaves),
            "launch_ms": median_ms(lambda: jax.block_until_ready(trivial(*leaves)), 50),
            "launch_small_args_ms": median_ms(lambda: jax.block_until_ready(trivial_small(*small)), 50),
        }
    )


if __name__ == "__main__":
    main()
