"""`python -m bridge.launch_server --mm-encoder-backend jax` as a real SGLang HTTP server on the CPU, beside
stock `sglang.launch_server`: the same answers over `/v1/chat/completions` and `/generate`; a corrupt
image is an error response and the server goes on; the encoder-only + language-only pair with the bridge
on the encoder side; the launcher refuses what it cannot serve before SGLang starts.

The servers serve the tiny MoE Qwen3-VL (SGLang's `Qwen3VLMoeForConditionalGeneration`); the Engine tests
(`test_bridge_sglang.py`) serve the dense one, so each of the bridge's two classes runs beside stock SGLang."""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from conftest import TINY
from qwen3vl_checkpoint import build
from sglang_server import server
from test_bridge_sglang import IMAGES, user_prompt

from bridge import backend
from bridge.launch_server import UsageError, gpu_past_the_first, pop_option, prepare, sglang_settings


def data_uri(path: Path) -> str:
    kind = "png" if path.suffix == ".png" else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def chat(url: str, images: list[str], text: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in images] + [{"type": "text", "text": text}]
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    return requests.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()


def generate(url: str, images: list[str], text: str) -> dict:
    body = {
        "text": user_prompt(len(images), text),
        "image_data": images,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
    }
    return requests.post(f"{url}/generate", json=body, timeout=120).json()


def answers(url: str) -> list:
    """What the tests compare: token ids/strings and log-probabilities of chat and generate requests."""
    astronaut, coffee = data_uri(IMAGES / "astronaut.jpg"), data_uri(IMAGES / "coffee.jpg")
    out = []
    for images, text in (([astronaut], "Describe."), ([coffee, astronaut], "Compare.")):
        c = chat(url, images, text)
        steps = c["choices"][0]["logprobs"]["content"]
        out.append([(s["token"], s["logprob"], [(t["token"], t["logprob"]) for t in s["top_logprobs"]]) for s in steps])
    g = generate(url, [str(IMAGES / "chelsea.png")], "Name it.")
    out.append([(t[1], t[0], []) for t in g["meta_info"]["output_token_logprobs"]])
    return out


def assert_same(got: list, ref: list) -> None:
    for g, r in zip(got, ref, strict=True):
        assert [s[0] for s in g] == [s[0] for s in r]
        np.testing.assert_allclose([s[1] for s in g], [s[1] for s in r], atol=1e-4)
        for sg, sr in zip(g, r, strict=True):
            assert [t[0] for t in sg[2]] == [t[0] for t in sr[2]]
            np.testing.assert_allclose([t[1] for t in sg[2]], [t[1] for t in sr[2]], atol=1e-4)


def server_env(tmp_path: Path) -> dict[str, str]:
    """SGLang's caches in the test's folder, the tower calls traced, only the smallest bucket warmed up."""
    return {"SGLANG_CACHE_DIR": str(tmp_path / "cache"), backend.TRACE_ENV: str(tmp_path / "trace.jsonl"),
            backend.WARMUP_ENV: "512"}  # fmt: skip


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("qwen3vl-http") / "model", TINY["hd64"], moe=True, seed=1)


@pytest.fixture(scope="module")
def stock(moe, tmp_path_factory) -> list:
    """Stock `sglang.launch_server`'s answers, the reference of every server test (one server start for all)."""
    folder = tmp_path_factory.mktemp("stock")
    env = server_env(folder)
    with server("sglang.launch_server", ["--model-path", str(moe)], folder / "stock.log", env) as url:
        found = answers(url)
    assert not (folder / "trace.jsonl").exists()  # stock SGLang never calls the bridge
    return found


def test_http_server_with_bridge_answers_like_stock_and_survives_a_corrupt_image(moe, stock, tmp_path):
    """With SGLang's DP encoder on (`--mm-enable-dp-encoder`, as README's several-GPU command has it): on one rank its
    `run_dp_sharded_mrope_vision_model` calls the tower with the items' rows it gathers (TP > 1 needs SGLang's CPU
    engine, a CPU build of sgl-kernel that PyPI does not have)."""
    env = server_env(tmp_path)
    args = ["--model-path", str(moe), "--mm-enable-dp-encoder"]
    with server("bridge.launch_server", ["--mm-encoder-backend", "jax", *args], tmp_path / "jax.log", env) as url:
        assert_same(answers(url), stock)
        truncated = "data:image/jpeg;base64," + base64.b64encode((IMAGES / "coffee.jpg").read_bytes()[:300]).decode()
        bad = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "default", "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": truncated}}]}],
        })  # fmt: skip
        assert bad.status_code >= 400, bad.text
        assert_same(answers(url), stock)  # served again (now from SGLang's per-image cache)
    calls = [json.loads(line)["grid_thw"] for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    # SGLang's own warm-up request (a 64x64 image) first; then astronaut, coffee, chelsea, each encoded once:
    # the second round and the repeated astronaut come from SGLang's per-image cache.
    assert calls == [[[1, 4, 4]], [[1, 16, 16]], [[1, 12, 18]], [[1, 12, 18]]], calls


def test_encoder_only_and_language_only_pair_with_the_bridge(moe, stock, tmp_path):
    env = server_env(tmp_path)
    args = ["--model-path", str(moe)]
    encoder = ["--mm-encoder-backend", "jax", *args, "--encoder-only"]
    with server("bridge.launch_server", encoder, tmp_path / "encoder.log", env) as enc_url:
        language = [*args, "--language-only", "--encoder-urls", enc_url]
        with server("sglang.launch_server", language, tmp_path / "language.log", env) as url:
            assert_same(answers(url), stock)
    calls = [json.loads(line)["grid_thw"] for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    # Every tower call ran on the encoder server (the servers' warm-up images aside): the encoder server keeps
    # no per-image cache unless asked (--enable-prefix-mm-cache), so the second request encodes both images.
    assert [c for c in calls if c != [[1, 4, 4]]] == [[[1, 16, 16]], [[1, 12, 18], [1, 16, 16]], [[1, 12, 18]]]


def test_launcher_strips_its_flag_and_refuses_what_it_cannot_serve(moe, tmp_path, monkeypatch):
    names = (backend.BACKEND_ENV, backend.PACKAGE_ENV, backend.PROCESSORS_ENV, backend.VLM_CACHE_ENV)
    for var in (*names, *backend.XLA_MEMORY_ENVS):
        monkeypatch.delenv(var, raising=False)
    args = ["--mm-encoder-backend=jax", "--model-path", str(moe), "--port", "1"]
    assert prepare(args) == ["--model-path", str(moe), "--port", "1"]
    import os

    assert os.environ[backend.PACKAGE_ENV] == "bridge.sglang_models"
    assert os.environ[backend.VLM_CACHE_ENV] == "4096" and os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert pop_option(["--model", "m", "--model-path=x"], ["--model-path", "--model"], remove=False) == "x"
    with pytest.raises(UsageError, match=r"--mm-encoder-backend 'tensorflow': expected one of jax, torch"):
        prepare(["--mm-encoder-backend", "tensorflow", "--model-path", str(moe)])
    with pytest.raises(UsageError, match=r"--mm-encoder-backend '': expected one of jax, torch"):
        prepare(["--mm-encoder-backend=", "--model-path", str(moe)])
    # SGLang's --config FILE.yaml: the model is read from it as SGLang reads it.
    (tmp_path / "serve.yaml").write_text(f"model-path: {moe}\nport: 1\n")
    assert prepare(["--config", str(tmp_path / "serve.yaml")]) == ["--config", str(tmp_path / "serve.yaml")]
    with pytest.raises(UsageError, match=r"--config: .*not found"):
        prepare(["--config", str(tmp_path / "missing.yaml")])
    # SGLang's Transformers backend would build a class of its own, with HF's torch tower.
    with pytest.raises(UsageError, match=r"^--model-impl transformers: --mm-encoder-backend jax runs in SGLang's own"):
        prepare(["--model-path", str(moe), "--model-impl", "transformers"])
    with pytest.raises(UsageError, match=r"^--model-impl transformers: "):  # SGLang's parser takes abbreviations
        prepare(["--model-p", str(moe), "--model-i", "transformers"])
    (tmp_path / "impl.yaml").write_text(f"model-path: {moe}\nmodel-impl: transformers\n")
    with pytest.raises(UsageError, match=r"^--model-impl transformers: "):
        prepare(["--config", str(tmp_path / "impl.yaml")])
    assert prepare(["--model-path", str(moe), "--model-impl=sglang"]) == [
        "--model-path",
        str(moe),
        "--model-impl=sglang",
    ]
    torch_impl = ["--model-path", str(moe), "--model-impl", "transformers"]
    assert prepare(["--mm-encoder-backend", "torch", *torch_impl]) == torch_impl  # stock SGLang: the user's choice
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UsageError, match=r"\['LlamaForCausalLM'\] is not Qwen3-VL; --mm-encoder-backend jax serves"):
        prepare(["--mm-encoder-backend", "jax", "--model-path", str(other)])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match=rf"^{broken / 'config.json'}: not a readable JSON config \(Expecting"):
        prepare(["--model-path", str(broken)])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    not_there = r"^--model-path no-such-org/no-such-model: no such directory, nor a hub model \("
    with pytest.raises(UsageError, match=not_there):
        prepare(["--model-path", "no-such-org/no-such-model"])
    # SGLang's --dtype float32 gives float32 towers, which no flash path runs; its "auto" gives 16-bit ones.
    monkeypatch.setenv("VITJAX_ATTENTION", "cudnn_padded")
    with pytest.raises(UsageError, match=r"VITJAX_ATTENTION='cudnn_padded': attention 'cudnn_padded' takes bfloat16"):
        prepare(["--model-path", str(moe), "--dtype", "float32"])
    with pytest.raises(UsageError, match=r"VITJAX_ATTENTION='cudnn_padded': attention 'cudnn_padded' takes bfloat16"):
        prepare(["--model-path", str(moe), "--dt", "float32"])  # abbreviated, as SGLang's parser reads it
    # With 16-bit towers it runs on CUDA GPUs only: refused where SGLang has none (here; or --device cpu), before
    # SGLang starts (the tower used to refuse it after the language model had loaded).
    with pytest.raises(UsageError, match=r"VITJAX_ATTENTION='cudnn_padded': runs on CUDA GPUs only, and SGLang runs"):
        prepare(["--model-path", str(moe), "--dtype=auto"])
    monkeypatch.delenv("VITJAX_ATTENTION")
    monkeypatch.setenv(backend.FIT_GRANULE_ENV, "6")  # read only after the language model loads: checked here
    with pytest.raises(UsageError, match=r"VITJAX_FIT_GRANULE='6': expected 0 \(off\) or a multiple of 4 tokens"):
        prepare(["--model-path", str(moe)])
    monkeypatch.delenv(backend.FIT_GRANULE_ENV)
    # A path that is not there is no hub id; object storage SGLang reads itself (its config is not checked here).
    with pytest.raises(UsageError, match=rf"^--model-path {tmp_path / 'Qwen3-VL-8B-Instrcut'}: no such directory$"):
        prepare(["--model-path", str(tmp_path / "Qwen3-VL-8B-Instrcut")])
    assert prepare(["--model-path", "s3://models/qwen3-vl"]) == ["--model-path", "s3://models/qwen3-vl"]
    model = ["--model-path", str(moe)]
    # Settings the jax backend cannot serve with, refused before SGLang starts.
    (tmp_path / "backend.yaml").write_text(f"model-path: {moe}\nmm-encoder-backend: torch\n")
    with pytest.raises(UsageError, match=r"^--config: mm-encoder-backend is the launcher's setting, not SGLang's"):
        prepare(["--config", str(tmp_path / "backend.yaml")])
    with pytest.raises(UsageError, match=r"^--language-only: a language server runs no vision tower; start it with"):
        prepare(["--model-path", str(moe), "--language-only", "--encoder-urls", "http://127.0.0.1:1"])
    with pytest.raises(UsageError, match=r"^--language-only: "):
        prepare(["--model-path", str(moe), "--language-o", "--encoder-urls", "http://127.0.0.1:1"])
    (tmp_path / "flags.yaml").write_text(f"model-path: {moe}\nlanguage-only: false\n")  # false: no flag, as in SGLang
    assert prepare(["--config", str(tmp_path / "flags.yaml")]) == ["--config", str(tmp_path / "flags.yaml")]
    monkeypatch.setenv("SGLANG_RUST_SERVER", "1")
    with pytest.raises(UsageError, match=r"^SGLANG_RUST_SERVER=1: SGLang's Rust front end does not take the bridge's"):
        prepare(["--model-path", str(moe)])
    monkeypatch.delenv("SGLANG_RUST_SERVER")
    # A CPU-only JAX where SGLang runs on CUDA GPUs (this machine has none: torch is told it has).
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda, "is_available", lambda: True)
        find_spec = importlib.util.find_spec  # and JAX's CUDA plugin is not installed, whatever this machine has
        patched.setattr(
            importlib.util,
            "find_spec",
            lambda name, *rest, **kw: None if name.startswith("jax_cuda") else find_spec(name, *rest, **kw),
        )
        with pytest.raises(UsageError, match=r"^--mm-encoder-backend jax on CUDA GPUs needs JAX's CUDA build"):
            prepare(["--model-path", str(moe)])
        assert prepare([*model, "--device", "cpu"]) == [*model, "--device", "cpu"]
        patched.setattr(
            importlib.util,
            "find_spec",
            lambda name, *rest, **kw: find_spec("jax" if name.startswith("jax_cuda") else name, *rest, **kw),
        )  # now JAX's CUDA plugin "is" installed
        patched.setenv("VITJAX_ATTENTION", "cudnn_padded")
        assert prepare([*model, "--dtype=auto"]) == [*model, "--dtype=auto"]  # on CUDA GPUs: taken
        with pytest.raises(UsageError, match=r"VITJAX_ATTENTION='cudnn_padded': runs on CUDA GPUs only"):
            prepare([*model, "--dev", "cpu"])
    # The same refusal from the command line: exit 2 and one line, before SGLang starts.
    proc = subprocess.run([sys.executable, "-m", "bridge.launch_server", "--model-path", str(other)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith("bridge.launch_server: error:"), proc.stderr
    # --help is SGLang's, after the launcher's own line.
    proc = subprocess.run([sys.executable, "-m", "bridge.launch_server", "--help"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("bridge.launch_server: --mm-encoder-backend {jax,torch} (default jax), then")
    assert "--model-path" in proc.stdout and "--mem-fraction-static" in proc.stdout
    # --help right after the launcher's flag is still help (it used to be taken as the flag's value)
    proc = subprocess.run([sys.executable, "-m", "bridge.launch_server", "--mm-encoder-backend", "--help"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "--mem-fraction-static" in proc.stdout, proc.stderr


def test_launcher_refuses_preallocation_where_a_rank_opens_every_gpu(moe, monkeypatch):
    """A rank's JAX tower on a GPU past the first opens every GPU (bridge.tower._open_gpus) and raises there if JAX
    would preallocate: after SGLang has started. The launcher finds the same case first, with SGLang's parser."""
    for var in (*backend.XLA_MEMORY_ENVS, "SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS"):
        monkeypatch.delenv(var, raising=False)
    assert backend.preallocates({}) and backend.preallocates({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})
    assert not backend.preallocates({"XLA_PYTHON_CLIENT_PREALLOCATE": "False"})
    assert not backend.preallocates({"XLA_PYTHON_CLIENT_ALLOCATOR": "Platform"})
    model = ["--model-path", str(moe)]

    def past(*extra: str) -> str | None:
        return gpu_past_the_first(sglang_settings([*model, *extra]))

    assert past("--tp-size", "2") == "--tp-size 2"
    assert past("--tp", "2", "--dp-size", "2") == "--tp-size 2 --dp-size 2"
    assert past("--base-gpu-id", "3") == "--base-gpu-id 3"
    assert past("--tp-size", "2", "--nnodes", "2") is None  # one GPU a node
    # attention DP: the dp ranks run inside the tp group, on its GPUs
    assert past("--tp", "2", "--dp", "2", "--enable-dp-attention", "--nnodes", "2") is None
    assert past("--tp", "2", "--dp", "2", "--enable-dp-attention") == "--tp-size 2"
    assert past() is None
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")  # the user's choice: JAX preallocates half
    with pytest.raises(UsageError, match=r"^--tp-size 2 runs towers on GPUs past the first.*PREALLOCATE=false$"):
        prepare([*model, "--tp-size", "2"])
    with pytest.raises(UsageError, match=r"^--base-gpu-id 1 runs towers"):
        prepare([*model, "--base-gpu-id=1"])
    assert prepare(model) == model  # one GPU, the first: preallocating there is the user's call
    assert past("--device", "cpu", "--tp-size", "2") is None  # no GPU to open
    monkeypatch.setenv("SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS", "1")  # every rank's GPU is its cuda:0
    assert prepare([*model, "--tp-size", "2"]) == [*model, "--tp-size", "2"]
    monkeypatch.delenv("SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    assert prepare([*model, "--tp-size", "2"]) == [*model, "--tp-size", "2"]
