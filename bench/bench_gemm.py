"""The tower's GEMMs alone, XLA (as the bucket executables compile them) beside PyTorch's cuBLAS, one GPU.

Each of the 8B tower's matmul shapes (qkv, proj, fc1 with its GELU, fc2, the mergers) at the 20x960x1280
row count (98,304) and at one 720p frame (3,584), bias included; plus the MLP width padded from 4,304
to 4,352 (a multiple of 256; zero columns in fc1 and zero rows in fc2 leave the block's output unchanged);
XLA with the weight stored [in, out] (Flax's layout) and [out, in] (HF's and PyTorch's).
The gap between the two columns is what better GEMMs could still buy. Then proj and fc2 with the block's residual
add (cuBLASLt's beta = 1), 27 in a loop as in the tower, with the residual read by the add alone or by a
second op too, and the cuBLASLt kernel each ran (`residual` rows). One JSON object per line.

    PYTHONPATH=. python bench/bench_gemm.py
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import torch
from bench_attention import pipelined_ms  # bench/ is on sys.path when run as a script
from bench_vit import op_times, versions

from vitjax.engine import COMPILER_OPTIONS

D, MLP, WIDE, OUT = 1152, 4304, 4608, 4096
SHAPES = {  # name: (rows divisor, K, N, GELU epilogue)
    "qkv": (1, D, 3 * D, False),
    "proj": (1, D, D, False),
    "fc1+gelu": (1, D, MLP, True),
    "fc1+gelu@4352": (1, D, 4352, True),
    "fc2": (1, MLP, D, False),
    "fc2@4352": (1, 4352, D, False),
    "merger_fc1": (4, WIDE, WIDE, False),
    "merger_fc2": (4, WIDE, OUT, False),
}
OPTIONS = {
    "bucket_options": COMPILER_OPTIONS,
    "xla_defaults": {},
    "cublas_no_lt": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": False},
}


def emit(**row) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def torch_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def main() -> None:
    emit(**versions())
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    emit(bench="square", impl="torch", tflops=2 * n**3 / torch_ms(lambda a=a: a @ a) / 1e9)
    ja = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    for opt_name, opts in OPTIONS.items():
        exe = jax.jit(lambda a: a @ a).lower(ja).compile(compiler_options=opts or None)
        emit(bench="square", impl="xla", options=opt_name, tflops=2 * n**3 / pipelined_ms(exe, ja) / 1e9)
    del a, ja
    for rows in (98304, 3584):
        for name, (div, k, nn, gelu) in SHAPES.items():
            m = rows // div
            flop = 2 * m * k * nn
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(nn, k, device="cuda", dtype=torch.bfloat16) * 0.02
            b = torch.randn(nn, device="cuda", dtype=torch.bfloat16)
            act = (lambda h: torch.nn.functional.gelu(h, approximate="tanh")) if gelu else (lambda h: h)
            t = torch_ms(lambda x=x, w=w, b=b, act=act: act(torch.nn.functional.linear(x, w, b)))
            emit(bench="gemm", impl="torch", shape=name, rows=m, ms=t, tflops=flop / t / 1e9)
            jx, jw, jb = (jnp.asarray(np.asarray(t.float().cpu())).astype(jnp.bfloat16) for t in (x, w, b))
            del x, w, b
            torch.cuda.empty_cache()
            for layout, contract in (("kn", 0), ("nk", 1)):  # weight stored [in, out] or [out, in] (HF's)
                wl = jw.T if layout == "kn" else jw

                def f(x, w, b, gelu=gelu, contract=contract):
                    h = jax.lax.dot_general(x, w, (((1,), (contract,)), ((), ()))) + b
                    return jax.nn.gelu(h, approximate=True) if gelu else h

                for opt_name, opts in OPTIONS.items():
                    exe = jax.jit(f).lower(jx, wl, jb).compile(compiler_options=opts or None)
                    t = pipelined_ms(exe, jx, wl, jb)
                    emit(
                        bench="gemm",
                        impl="xla",
                        options=opt_name,
                        weight=layout,
                        shape=name,
                        rows=m,
                        ms=t,
                        tflops=flop / t / 1e9,
                    )
    residual_gemms()


def residual_gemms(rows: int = 98304, blocks: int = 27) -> None:
    """x + (h @ w + b) for proj and fc2, `blocks` times in a loop, with the addend x read by the add alone (XLA
    lets cuBLASLt write the result onto it) or by a second op too, as a block's LayerNorm reads its residual (the
    result then goes to a new buffer): the kernel cuBLASLt ran and its time in each case."""
    for name, k in (("proj", D), ("fc2@4352", 4352)):
        h = jax.random.normal(jax.random.key(0), (rows, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(1), (k, D)) * 0.02).astype(jnp.bfloat16)
        b = jnp.full((D,), 0.1, jnp.bfloat16)
        x = jax.random.normal(jax.random.key(2), (rows, D), jnp.bfloat16)
        for users in (1, 2):

            def f(h, w, b, x, users=users):
                def step(i, carry):
                    x, seen = carry  # seen: a row of each addend, its second reader when users == 2
                    return x + (h @ w + b), seen + x[0] if users == 2 else seen

                return jax.lax.fori_loop(0, blocks, step, (x, jnp.zeros((D,), x.dtype)))

            exe = jax.jit(f).lower(h, w, b, x).compile(compiler_options=COMPILER_OPTIONS)
            _, kernel, ms = op_times(lambda exe=exe, h=h, w=w, b=b, x=x: exe(h, w, b, x))[0]
            emit(
                bench="residual",
                shape=name,
                rows=rows,
                addend_users=users,
                aliased="output_to_operand_aliasing" in exe.as_text(),
                kernel=kernel,
                ms=ms / blocks,
                tflops=2 * rows * k * D / (ms / blocks) / 1e9,
            )


if __name__ == "__main__":
    main()
