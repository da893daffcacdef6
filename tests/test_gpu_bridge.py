"""The SGLang bridge's tower adapter on CUDA: torch tensors in and out of a vitjax encoder on the same GPU.

Skipped without an NVIDIA GPU. JAX shares the GPU with torch (allocating on demand, as the bridge's launcher
sets it) and the CPU adapter runs beside it, so run:

    JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -m gpu -s tests/test_gpu_bridge.py

Shows: pixel rows read in place and features handed back in place (same device pointers), no race with torch
work queued on the caller's stream just before and just after the call (default and side stream), features
that outlive the JAX arrays, and outputs as close to HF fp32 as HF's own bf16 tower (8B config, bf16 tower) and
close to the CPU adapter (tiny config), and a tower that outlives a pause and resume of SGLang's memory saver (where
torch_memory_saver is installed). Prints each framework's memory peak.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX opens the GPU: torch shares it

import jax
import numpy as np
import pytest
import torch
from conftest import GRIDS, TINY, bf16_error_ratio, hf_outputs, hf_vision_config, hf_vision_model, pixels_for
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

import bridge
import vitjax
from bridge import dlpack
from vitjax import layout


def _gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("JAX_PLATFORMS", "") not in ("", "cpu")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda,cpu)")]

# 720p, a portrait photo and a 2-frame video: 3520 + 768 + 480 patches.
GRIDS_8B = [(1, 44, 80), (1, 32, 24), (2, 12, 20)]
CUDA = torch.device("cuda", 0)


def _cos(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    a, b = (np.asarray(torch.as_tensor(x).detach().double().cpu()).ravel() for x in (a, b))
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _hf(model: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """HF's output (float32) in SGLang's column layout, on the GPU."""
    out = model(pixels.to(model.dtype), grid_thw=torch.tensor(GRIDS_8B, device=CUDA))
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1).float()


def _tower(hf: torch.nn.Module, cfg: vitjax.VisionConfig, device: torch.device | str) -> bridge.JaxVisionTower:
    """A bf16 tower built as SGLang builds it (config, device, dtype), then loaded from HF's named tensors."""
    tower = bridge.JaxVisionTower(config=cfg, device=device, dtype=torch.bfloat16)
    tower.load(((k, v.detach().cpu().numpy()) for k, v in hf.state_dict().items()), where="HF state_dict")
    return tower


@pytest.fixture(scope="module")
def hf8b():
    """HF's fp32 tower on the 8B config with random weights (norms and biases perturbed), on cuda:0."""
    cfg = vitjax.VisionConfig.preset("qwen3-vl-8b")
    torch.manual_seed(0)
    hf = Qwen3VLVisionModel._from_config(hf_vision_config(cfg), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.05)
    return cfg, hf.to(CUDA)


@pytest.fixture(scope="module")
def tower8b(hf8b):
    cfg, hf = hf8b
    tower = _tower(hf, cfg, CUDA)
    assert tower.encoder.parallel.engines[0].devices[0].platform == "gpu"
    return tower


class Spy:
    """Records what the real `encode_patches` was given and returned (the pointers the tower passed on)."""

    def __init__(self, encoder: vitjax.Encoder):
        self.encode_patches, self.pixels, self.outs = encoder.encode_patches, [], []

    def __call__(self, pixel_values, grid_thw):
        self.pixels.append(pixel_values)
        self.outs.append(self.encode_patches(pixel_values, grid_thw))
        return self.outs[-1]


def test_cuda_tower_equals_hf_fp32_and_reads_pixels_in_place(hf8b, tower8b, monkeypatch):
    cfg, hf = hf8b
    tokens = sum(layout.grid_tokens(g) for g in GRIDS_8B)
    pixels = torch.randn(tokens, cfg.patch_dim, device=CUDA, generator=torch.Generator(CUDA).manual_seed(1))
    with torch.inference_mode():
        ref, hf_bf16 = (_hf(model, pixels) for model in (hf, copy.deepcopy(hf).to(torch.bfloat16)))
    rows = pixels.to(torch.bfloat16)
    assert dlpack.to_jax(rows).unsafe_buffer_pointer() == rows.data_ptr()
    spy = Spy(tower8b.encoder)
    monkeypatch.setattr(tower8b.encoder, "encode_patches", spy)
    torch.cuda.reset_peak_memory_stats(CUDA)
    features = tower8b(rows, torch.tensor(GRIDS_8B))
    assert spy.pixels[-1].unsafe_buffer_pointer() == rows.data_ptr()  # pixels read in place
    assert features.device == CUDA and features.dtype == torch.bfloat16
    assert features.shape == (tokens // 4, tower8b.out_hidden_size)
    for i, (start, n) in enumerate(layout.split_points(GRIDS_8B)):
        got, want = features[start : start + n].float(), ref[start : start + n]
        mae, hf_mae = float((got - want).abs().mean()), float((hf_bf16[start : start + n] - want).abs().mean())
        print(f"8B image {i} {GRIDS_8B[i]} vs HF fp32: cos {_cos(got, want):.6f} mae {mae:.3e} (HF bf16 {hf_mae:.3e})")
        assert mae <= 1.5 * hf_mae, (i, mae, hf_mae)
    # The same rows from the host (copied up in chunks) give the same features.
    assert torch.equal(tower8b(rows.cpu(), torch.tensor(GRIDS_8B)), features)
    # One image: the features are a copy of the encoder's row view (SGLang's cache counts a tensor's own bytes).
    single = tower8b(rows[:3520], torch.tensor([GRIDS_8B[0]]))
    assert single.data_ptr() != spy.outs[-1][0].unsafe_buffer_pointer()
    assert torch.equal(single, dlpack.to_torch(spy.outs[-1][0]))
    assert _cos(single, ref[:880]) > 0.995
    peak = jax.devices("gpu")[0].memory_stats()
    print(
        f"memory peak: torch {torch.cuda.max_memory_allocated(CUDA) / 2**30:.2f} GiB (HF fp32 weights, pixels), "
        f"JAX {peak['peak_bytes_in_use'] / 2**30:.2f} GiB (bf16 weights, buckets), JAX now "
        f"{peak['bytes_in_use'] / 2**30:.2f} GiB"
    )


def test_no_race_with_torch_work_queued_before_and_after(hf8b, tower8b):
    """Pixels written by torch at the end of ~50 ms of queued GPU work, features read by torch at once after
    the call: equal to the same call made with everything synchronised, on the default and a side stream."""
    cfg, _ = hf8b
    grids = torch.tensor([[1, 32, 24]])
    gen = torch.Generator(CUDA).manual_seed(2)
    sources = [torch.randn(768, cfg.patch_dim, device=CUDA, generator=gen).to(torch.bfloat16) for _ in range(2)]
    refs = []
    for src in sources:
        torch.cuda.synchronize()
        refs.append(tower8b(src.clone(), grids).clone())
        torch.cuda.synchronize()
    kept = []
    for stream in (torch.cuda.current_stream(CUDA), torch.cuda.Stream(CUDA)):
        for src, ref in zip(sources, refs, strict=True):
            with torch.cuda.stream(stream):
                pixels = torch.full_like(src, float("nan"))
                torch.cuda._sleep(100_000_000)  # a busy kernel, so the write below lands late
                pixels.copy_(src)
                features = tower8b(pixels, grids)
                doubled = features * 2  # torch reads the features right away, on the same stream
                kept.append((features, ref))
            stream.synchronize()
            assert torch.equal(doubled, ref * 2), float((doubled - ref * 2).abs().max())
    torch.cuda.synchronize()
    for features, ref in kept:  # the torch tensors keep the JAX buffers alive through later calls
        assert torch.equal(features, ref)


def test_cuda_tower_equals_cpu_tower_and_hf():
    """Tiny config: the CUDA adapter (bf16) against the CPU adapter (bf16) and HF fp32 on the CPU."""
    cfg = TINY["hd72"]
    hf = hf_vision_model(cfg, seed=4)
    pixels = pixels_for(GRIDS, cfg, seed=4)
    ref = hf_outputs(hf, pixels, GRIDS)
    cpu = _tower(hf, cfg, "cpu")(torch.from_numpy(pixels).to(torch.bfloat16), torch.tensor(GRIDS))
    gpu = _tower(hf, cfg, CUDA)(torch.from_numpy(pixels).to(CUDA, torch.bfloat16), torch.tensor(GRIDS))
    assert (cpu.device.type, gpu.device) == ("cpu", CUDA)
    cos_cpu, cos_hf = _cos(gpu, cpu), _cos(gpu, ref)
    print(f"tiny: CUDA vs CPU adapter cos {cos_cpu:.6f}, CUDA vs HF fp32 cos {cos_hf:.6f}")
    assert cos_cpu > 0.999 and bf16_error_ratio(gpu.float().cpu().numpy(), hf, pixels, GRIDS) <= 1.5


LAST_GPU = """
import json, sys
import numpy as np, torch
from conftest import GRIDS, TINY, bf16_error_ratio, hf_vision_model, pixels_for
import bridge
k = torch.cuda.device_count() - 1
torch.cuda.set_device(k)  # as SGLang's TP rank k does before it builds the model
torch.zeros(1, device=f"cuda:{k}")
cfg = TINY["hd72"]
hf = hf_vision_model(cfg, seed=5)
pixels = pixels_for(GRIDS, cfg, seed=5)
tower = bridge.JaxVisionTower(config=cfg, device=f"cuda:{k}", dtype=torch.bfloat16)
tower.load(((n, v.numpy()) for n, v in hf.state_dict().items()), where="HF state_dict")
out = tower(torch.from_numpy(pixels).to(f"cuda:{k}", torch.bfloat16), torch.tensor(GRIDS))
ratio = bf16_error_ratio(out.float().cpu().numpy(), hf, pixels, GRIDS)
import jax
others = {str(d): d.memory_stats().get("bytes_in_use", 0) for d in jax.devices("gpu") if d.id != k}
print(json.dumps({"gpu": k, "features": str(out.device), "jax": str(tower.encoder.parallel.engines[0].devices[0]),
                  "ratio": ratio, "others": others, "torch_device": torch.cuda.current_device()}))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tower_on_a_gpu_other_than_the_first():
    """A TP rank on GPU k > 0 builds its tower there, in a process where JAX has not started (its own)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), str(Path(__file__).parent)])}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    run = subprocess.run([sys.executable, "-c", LAST_GPU], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"tower on cuda:{got['gpu']}: JAX device {got['jax']}, bf16 error vs HF's own {got['ratio']:.3f}x, JAX "
          f"bytes on the other GPUs {got['others']}")  # fmt: skip
    k = got["gpu"]
    assert (got["features"], got["jax"]) == (f"cuda:{k}", f"cuda:{k}") and got["ratio"] <= 1.5
    assert set(got["others"].values()) == {0}  # nothing of the tower's on the GPUs it does not run on
    assert got["torch_device"] == k  # torch's current device is where the rank left it
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    run = subprocess.run([sys.executable, "-c", LAST_GPU], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode != 0 and "XLA_PYTHON_CLIENT_PREALLOCATE must be false" in run.stderr


MEMORY_SAVER = """
import json
import torch
from torch_memory_saver import torch_memory_saver as saver
import bridge, vitjax
from vitjax.buckets import Bucket
free = lambda: torch.cuda.mem_get_info()[0] / 2**30
# Where SGLang builds and loads the model; the warm-up, which SGLang runs just after, inside too (the stricter case).
with saver.region(tag="weights", enable_cpu_backup=False):
    control = torch.full((1 << 28,), 3.0, device="cuda")  # 1 GiB of torch weights: what the saver is for
    tower = bridge.JaxVisionTower(config=vitjax.VisionConfig.preset("qwen3-vl-8b"), device="cuda", dtype=torch.bfloat16)
    tower.load_random(seed=0)
    tower.warmup([Bucket(3584, 1)])
pixels = torch.randn(3520, 1536, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
grid = torch.tensor([[1, 44, 80]])
before = tower(pixels, grid).cpu()
torch.cuda.synchronize()
used = free()
saver.pause("weights")  # release_memory_occupation
freed = free() - used
saver.resume("weights")  # resume_memory_occupation
after = tower(pixels, grid).cpu()
print(json.dumps({"freed_gib": freed, "same": torch.equal(before, after), "attention": tower.encoder.attention}))
"""


@pytest.mark.skipif(importlib.util.find_spec("torch_memory_saver") is None, reason="needs torch_memory_saver")
def test_the_tower_outlives_sglangs_memory_saver():
    """SGLang's memory saver (RL trainers' `release_memory_occupation`) builds the model inside torch_memory_saver's
    "weights" region, then pauses it: whatever was allocated there through cudaMalloc is unmapped, and on resume mapped
    again empty (without a CPU backup). XLA allocates through the CUDA driver, outside the saver's hook: the JAX tower's
    memory (its weights and working memory, fa4's kernels included where installed) stays through a pause, and its
    output after the resume is the same, bit for bit. The torch control shows the saver at work (its GiB freed)."""
    import json
    import subprocess
    import sys

    from torch_memory_saver import configure_subprocess

    paths = [str(Path(__file__).parents[1]), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    with configure_subprocess():  # the saver's preload library, as SGLang starts its scheduler processes
        env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    run = subprocess.run([sys.executable, "-c", MEMORY_SAVER], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"memory saver: paused {got['freed_gib']:.3f} GiB (the torch control's 1), tower output after resume "
          f"the same: {got['same']} ({got['attention']})")  # fmt: skip
    assert abs(got["freed_gib"] - 1) < 0.01  # the control's GiB (1.000 on an H100), and nothing of JAX's
    assert got["same"]


TWO_GPUS = """
import json
import jax, jax.numpy as jnp, numpy as np, torch
from conftest import GRIDS, TINY, bf16_error_ratio, hf_outputs, hf_vision_model, pixels_for
import bridge, vitjax
from vitjax.weights import from_named_arrays
cfg = TINY["hd72"]
hf = hf_vision_model(cfg, seed=6)
pixels = pixels_for(GRIDS, cfg, seed=6)
params = from_named_arrays(((n, v.numpy()) for n, v in hf.state_dict().items()), cfg, "HF state_dict")
enc = vitjax.Encoder.from_params(cfg, params, "bfloat16", devices=2, cache_bytes=0)
outs = enc.encode_patches(pixels.astype(jnp.bfloat16), np.asarray(GRIDS))
held = sorted({str(d) for out in outs for d in out.devices()})
out = bridge.JaxVisionTower(enc)(torch.from_numpy(pixels).to("cuda:0", torch.bfloat16), torch.tensor(GRIDS))
ref = hf_outputs(hf, pixels, GRIDS)
print(json.dumps({"held": held, "features": str(out.device), "shapes": [list(out.shape), list(ref.shape)],
                  "ratio": bf16_error_ratio(out.float().cpu().numpy(), hf, pixels, GRIDS)}))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tower_over_an_encoder_on_two_gpus():
    """`bridge.JaxVisionTower(enc)` over an encoder on two GPUs (its own process, so JAX opens both): each image's
    features stay on the GPU that ran it, and the tower gathers them into one tensor on its device, equal to HF."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), str(Path(__file__).parent)])}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    run = subprocess.run([sys.executable, "-c", TWO_GPUS], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"encoder on {got['held']}: features on {got['features']}, bf16 error vs HF's own {got['ratio']:.3f}x")
    assert got["held"] == ["cuda:0", "cuda:1"] and got["features"] == "cuda:0"
    assert got["shapes"][0] == got["shapes"][1] and got["ratio"] <= 1.5
