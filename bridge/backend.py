"""Which tower SGLang runs, and the process environment the JAX tower needs.

Settings reach SGLang's spawned scheduler and encoder processes only through the environment (SGLang's
argument parser is closed; reference/sglang-integration.md §3, §10), so the launcher writes them there
before SGLang starts, and every process reads them back from there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vitjax.buckets imports JAX, which SGLang's tokenizer processes do not need
    from vitjax.buckets import Bucket, BucketPolicy

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
# The granule of fitted buckets (`vitjax.buckets.BucketPolicy.fit_granule`): a repeated call size moves to a bucket
# of its tokens rounded up to this, compiled on a background thread while serving; "0" keeps every call on the ladder.
FIT_GRANULE_ENV = "VITJAX_FIT_GRANULE"
# A file to append one JSON line per tower call to (pid, grid_thw, seconds): what ran, where, how long.
TRACE_ENV = "VITJAX_TRACE"
# JAX must not take GPU memory that SGLang's KV-cache sizing counts on: allocate on demand.
XLA_MEMORY_ENVS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")


def preallocates(environ: Mapping[str, str] | None = None) -> bool:
    """Whether JAX will preallocate GPU memory, read as jaxlib's xla_client reads the variables (checked on
    JAX 0.10.2 and 0.11.2): the "platform" allocator never does; otherwise unless PREALLOCATE is false."""
    env = os.environ if environ is None else environ
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower() == "platform":
        return False
    return env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true") not in ("false", "False", "0")


def bucket_policy(environ: Mapping[str, str] | None = None) -> BucketPolicy:
    """The tower's bucket policy: vitjax's default, with the fitted-bucket granule `VITJAX_FIT_GRANULE` sets."""
    from vitjax.buckets import BucketPolicy

    env = os.environ if environ is None else environ
    value = env.get(FIT_GRANULE_ENV, "").strip()
    if not value:
        return BucketPolicy()
    try:
        return BucketPolicy(fit_granule=int(value))
    except ValueError:
        raise ValueError(f"{FIT_GRANULE_ENV}={value!r}: expected 0 (off) or a multiple of 4 tokens") from None


def warmup_buckets(policy: BucketPolicy, environ: Mapping[str, str] | None = None) -> list[Bucket] | None:
    """The buckets `VITJAX_WARMUP` asks to compile before serving: None for "all" (the default), none for
    "none", or those of the listed token sizes ("512,4096"), which must be sizes of `policy`'s ladder."""
    env = os.environ if environ is None else environ
    choice = env.get(WARMUP_ENV, "all").strip()
    if choice in ("all", "none"):
        return None if choice == "all" else []
    try:
        sizes = {int(v) for v in choice.split(",")}
    except ValueError:
        sizes = set()
    if not sizes or not sizes <= set(policy.tokens):
        raise ValueError(f"{WARMUP_ENV}={choice!r}: expected all, none or bucket sizes from {policy.tokens}")
    return [b for b in policy.buckets() if b.tokens in sizes]


def check_attention(environ: Mapping[str, str], dtype: str | None = None, gpus: bool = True) -> None:
    """`VITJAX_ATTENTION`, if set, names an attention path this process can run on a tower of `dtype` (SGLang's
    `--dtype`; None: one the flash paths take), on CUDA GPUs or (`gpus` false) not, which the tower reads at load."""
    from vitjax.attention import ENV_VAR, GPU_ONLY, check_implementation

    if value := environ.get(ENV_VAR):
        try:
            check_implementation(value, dtype)
        except ValueError as e:
            raise ValueError(f"{ENV_VAR}={value!r}: {e}") from None
        if not gpus and value in GPU_ONLY:
            raise ValueError(
                f"{ENV_VAR}={value!r}: runs on CUDA GPUs only, and SGLang runs here without them (--device, or no "
                "CUDA GPU found); use 'reference' or leave the choice to vitjax"
            )


def check_trace(environ: Mapping[str, str]) -> None:
    """`VITJAX_TRACE`, if set, is a file the tower can append to (it is created here if missing)."""
    if path := environ.get(TRACE_ENV):
        try:
            with open(path, "a"):
                pass
        except OSError as e:
            raise ValueError(f"{TRACE_ENV}={path!r}: cannot append to it ({e.strerror or e})") from None


def current() -> str:
    """The backend this process was launched with ("torch", SGLang's own tower, when unset)."""
    value = os.environ.get(BACKEND_ENV, "torch")
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def configure(
    backend: str, environ: dict[str, str] | None = None, dtype: str | None = None, gpus: bool = True
) -> dict[str, str]:
    """Write the environment for `backend` (unless the user already set a variable); return what was set. `dtype`:
    the towers' (SGLang's `--dtype`, where it names one); `gpus`: whether SGLang runs on CUDA GPUs."""
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
    if backend == "jax":  # the tower reads these after SGLang has loaded the language model: check them now
        warmup_buckets(bucket_policy(env), env)
        check_attention(env, dtype, gpus)
        check_trace(env)
    env.update(wanted)
    return wanted
