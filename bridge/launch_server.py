"""`python -m bridge.launch_server --mm-encoder-backend {jax,torch} <sglang.launch_server arguments>`.

Strips its own flag (SGLang's parser rejects unknown ones), checks the model and the hook, writes the
environment SGLang's spawned processes read (`bridge.backend`), then runs SGLang's own launcher unchanged.
`torch` is stock SGLang; `jax` serves Qwen3-VL (dense or MoE) with vitjax's tower.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from bridge import backend

FLAG = "--mm-encoder-backend"
# SGLang 0.5.23's `--dtype` names (`_STR_DTYPE_TO_TORCH_DTYPE`) -> the towers' dtype. Its "auto" gives a float32
# checkpoint float16 (`_get_and_verify_dtype`), so only a named float32 makes a tower the flash kernels cannot run.
SGLANG_DTYPES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


class UsageError(ValueError):
    """A launch refused before SGLang starts; the message says what is accepted."""


def pop_option(argv: list[str], names: Sequence[str], remove: bool) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` (the last one given), optionally removed from `argv`."""
    value, i = None, 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if name in names:
            if eq:
                value, width = inline, 1
            elif i + 1 < len(argv):
                value, width = argv[i + 1], 2
            else:
                raise UsageError(f"{name} needs a value")
            if remove:
                del argv[i : i + width]
                continue
            i += width
            continue
        i += 1
    return value


def model_architectures(model: str) -> list[str] | None:
    """`architectures` of a model directory's config.json (or, for a hub id, transformers' AutoConfig); None for an
    object-storage URI (s3://, gs://, az://: SGLang fetches its config itself, checked on 0.5.23)."""
    config = Path(model) / "config.json"
    if config.is_file():
        try:
            found = json.loads(config.read_text())
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise UsageError(f"{config}: not a readable JSON config ({e})") from None
        return list((found.get("architectures") if isinstance(found, dict) else None) or [])
    if Path(model).exists():
        raise UsageError(f"{model}: no config.json there")
    from sglang.srt.utils.runai_utils import is_runai_obj_uri

    if is_runai_obj_uri(model):
        return None
    if model.startswith(("/", ".", "~")):  # a path, not a hub id: say so, not what the hub makes of it
        raise UsageError(f"--model-path {model}: no such directory")
    from transformers import AutoConfig

    try:
        return list(getattr(AutoConfig.from_pretrained(model), "architectures", None) or [])
    except (OSError, ValueError) as e:  # not a folder here, and not a model transformers can find
        reason = str(e).splitlines()[0]
        raise UsageError(f"--model-path {model}: no such directory, nor a hub model ({reason})") from None


def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own argument parser (`ServerArgs.add_cli_args`, checked on 0.5.23), to read its settings as it will."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def with_config_file(argv: list[str]) -> list[str]:
    """`argv` with the settings of a `--config FILE.yaml` merged in, by SGLang's own merger (checked on 0.5.23),
    so the model is looked for where SGLang will find it."""
    if "--config" not in argv:
        return argv
    import yaml
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    try:  # with SGLang's parser, as SGLang merges: a flag set false in the file is left out, not passed "false"
        return ConfigArgumentMerger(sglang_parser()).merge_config_with_args(argv)
    except (ValueError, OSError, yaml.YAMLError) as e:
        raise UsageError(f"--config: {e}") from None


def sglang_settings(argv: list[str]) -> argparse.Namespace | None:
    """SGLang's settings as its own parser reads `argv` (abbreviated flags too: `--model-i` is `--model-impl`), or
    None for arguments it refuses, which SGLang then does itself, in its own words."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return sglang_parser().parse_known_args(argv)[0]
    except SystemExit:
        return None


def on_cuda(device: str | None) -> bool:
    """Whether SGLang runs on CUDA GPUs: its `--device`, or CUDA where torch finds it (SGLang's default)."""
    import torch

    return (device or "cuda").startswith("cuda") and torch.cuda.is_available()


def gpu_past_the_first(args: argparse.Namespace | None) -> str | None:
    """The settings (`sglang_settings`) that put some rank on a GPU other than its process's first, or None, by
    SGLang's rank-to-GPU rule (checked on 0.5.23). A JAX tower on such a GPU opens them all
    (`bridge.tower._open_gpus`); on another `--device` there is none."""
    from sglang.srt.environ import envs

    if envs.SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS.get():  # each rank sees only its own GPU, as cuda:0
        return None
    if args is None or not (args.device or "cuda").startswith("cuda"):
        return None
    # With attention DP (`--enable-dp-attention`) the dp ranks share the tp group's GPUs; else each is a replica.
    replicas = 1 if getattr(args, "enable_dp_attention", False) else args.dp_size
    sizes = {"--tp-size": args.tp_size, "--pp-size": args.pp_size, "--dp-size": replicas}
    if args.tp_size * args.pp_size * replicas > max(args.nnodes, 1):
        return " ".join(f"{flag} {size}" for flag, size in sizes.items() if size > 1)
    return f"--base-gpu-id {args.base_gpu_id}" if args.base_gpu_id > 0 else None


def check_jax_gpu(device: str | None) -> None:
    """Where SGLang runs on CUDA GPUs, JAX's CUDA plugin is installed (looked for without starting JAX here: SGLang's
    processes start it), so a CPU-only JAX is refused now, not in SGLang's processes once they build the model."""
    if on_cuda(device) and not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in ("13", "12")):
        raise UsageError(
            f"{FLAG} jax on CUDA GPUs needs JAX's CUDA build, which is not installed: pip install -e "
            "'.[sglang,cuda13]' (or cuda12)"
        )


def check_hook() -> None:
    """Import the external packages the way SGLang will, but strictly: SGLang only logs an import error there
    and would silently serve its own torch tower (and skip the request checks). `import_model_classes(...,
    strict=True)` is checked on sglang 0.5.23."""
    from sglang.srt.models.registry import import_model_classes

    from bridge.sglang_models import qwen3_vl
    from bridge.sglang_processors import qwen3_vl as processors  # noqa: F401 (SGLang would only log its errors)

    found = import_model_classes(backend.PACKAGE, strict=True)
    for arch in backend.ARCHITECTURES:
        if found.get(arch) is not getattr(qwen3_vl, arch):
            raise UsageError(f"{backend.PACKAGE} does not provide {arch} (found {found.get(arch)})")


def prepare(argv: Sequence[str]) -> list[str]:
    """Check the arguments and set the environment; return SGLang's arguments (ours removed)."""
    args = list(argv)
    choice = pop_option(args, [FLAG], remove=True)
    choice = "jax" if choice is None else choice
    if choice not in backend.BACKENDS:
        raise UsageError(f"{FLAG} {choice!r}: expected one of {', '.join(backend.BACKENDS)}")
    settings = with_config_file(args)
    if pop_option(settings, [FLAG], remove=False) is not None:  # only from --config's file: SGLang would refuse it
        raise UsageError(
            f"--config: {FLAG[2:]} is the launcher's setting, not SGLang's: give {FLAG} on the command line"
        )
    server = sglang_settings(settings)  # None: SGLang refuses these arguments itself, before any tower is built
    if choice == "jax" and server is not None:
        from sglang.srt.environ import envs

        if envs.SGLANG_RUST_SERVER.get():  # its front end serves only SGLang's own processor classes (0.5.23)
            raise UsageError(
                f"SGLANG_RUST_SERVER=1: SGLang's Rust front end does not take the bridge's request checks; unset it "
                f"to serve with {FLAG} jax"
            )
        if server.language_only:
            raise UsageError(
                f"--language-only: a language server runs no vision tower; start it with stock SGLang "
                f"(python -m sglang.launch_server), and {FLAG} jax on the --encoder-only side"
            )
        model = server.model_path
        archs = model_architectures(model)
        if archs is None:
            note = f"{model} is in object storage, where SGLang reads its config: the JAX tower runs if it is Qwen3-VL"
            print(f"bridge.launch_server: {note}", file=sys.stderr)
        elif not set(archs) & set(backend.ARCHITECTURES):
            raise UsageError(
                f"{model}: architectures {archs} is not Qwen3-VL; {FLAG} jax serves "
                f"{' and '.join(backend.ARCHITECTURES)} ({FLAG} torch runs any model on SGLang's own towers)"
            )
        # SGLang 0.5.23 builds another class for `--model-impl transformers` (its Transformers backend, with HF's
        # torch tower), so the JAX tower would silently not run.
        impl = server.model_impl
        if (impl or "auto").lower() not in ("auto", "sglang"):
            raise UsageError(f"--model-impl {impl}: {FLAG} jax runs in SGLang's own Qwen3-VL classes (auto or sglang)")
    dtype = None if server is None else server.dtype
    device = None if server is None else server.device
    try:
        backend.configure(choice, dtype=SGLANG_DTYPES.get((dtype or "auto").lower()), gpus=on_cuda(device))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if choice == "jax" and server is not None:
        check_jax_gpu(device)
        check_hook()
        if backend.preallocates() and (where := gpu_past_the_first(server)):
            raise UsageError(
                f"{where} runs towers on GPUs past the first, and a JAX tower there opens every GPU, so JAX must "
                "not preallocate (it would take memory on each of them): set XLA_PYTHON_CLIENT_PREALLOCATE=false"
            )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv):  # SGLang's own help, after ours
        print(f"bridge.launch_server: {FLAG} {{jax,torch}} (default jax), then sglang.launch_server's arguments:\n")
        argv = [
            a
            for i, a in enumerate(argv)
            if a.partition("=")[0] != FLAG and (i == 0 or argv[i - 1] != FLAG or a.startswith("-"))
        ]  # our flag and its value, not a --help it would take for one
        sys.argv = [sys.argv[0], *argv]
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        return
    try:
        args = prepare(argv)
    except UsageError as e:
        print(f"bridge.launch_server: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = [sys.argv[0], *args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
