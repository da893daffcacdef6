"""Which tower SGLang runs, and the process environment the JAX tower needs.

Settings reach SGLang's spawned scheduler and encoder processes only through the environment (SGLang's
argument parser is closed; reference/sglang-integration.md §3, §10), so the launcher writes them there
before SGLang starts, and every process reads them back from there.
"""

from __future__ import annotations

import os

BACKEND_ENV = "VITJAX_MM_ENCODER_BACKEND"
BACKENDS = ("jax", "torch")
PACKAGE = "bridge.sglang_models"
PACKAGE_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"
# The processor package checks each request's pixel rows against its grid in SGLang's tokenizer process.
PROCESSORS = "bridge.sglang_processors"
PROCESSORS_ENV = "SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"
# SGLang's architecture names the bridge serves (dense and MoE Qwen3-VL); they keep these names so that
# SGLang's processor lookup, Hopper defaults and pixel-deferral checks still match them.
ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
# SGLang's per-image embedding cache: its default is 100 MB, and 0 (off) on H100/H200. An 8B image of
# 1280 tokens is 42 MB of bf16 features, so the launcher keeps 4 GiB unless the user chose.
VLM_CACHE_ENV = "SGLANG_VLM_CACHE_SIZE_MB"
VLM_CACHE_MB = 4096
# Which bucket executables the tower compiles before SGLang sizes its KV cache ("all", "none", "512,4096").
WARMUP_ENV = "VITJAX_WARMUP"
# A file to append one JSON line per tower call to (pid, grid_thw, seconds): what ran, where, how long.
TRACE_ENV = "VITJAX_TRACE"
# JAX must not take GPU memory that SGLang's KV-cache sizing counts on: allocate on demand.
XLA_MEMORY_ENVS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")


def current() -> str:
    """The backend this process was launched with ("torch", SGLang's own tower, when unset)."""
    value = os.environ.get(BACKEND_ENV, "torch")
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def configure(backend: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Write the environment for `backend` (unless the user already set a variable); return what was set."""
    if backend not in BACKENDS:
        raise ValueError(f"--mm-encoder-backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    env = os.environ if environ is None else environ
    wanted = {BACKEND_ENV: backend}
    if backend == "jax":
        wanted[PACKAGE_ENV] = PACKAGE
        wanted[PROCESSORS_ENV] = PROCESSORS
        if VLM_CACHE_ENV not in env:
            wanted[VLM_CACHE_ENV] = str(VLM_CACHE_MB)
        if not any(k in env for k in XLA_MEMORY_ENVS):
            wanted["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    for name, needed in ((PACKAGE_ENV, PACKAGE), (PROCESSORS_ENV, PROCESSORS)):
        if backend == "jax" and env.get(name, needed) != needed:
            raise ValueError(f"{name} is already set to {env[name]!r}; the jax backend needs {needed!r}")
    env.update(wanted)
    return wanted
