"""Shared fixtures: tiny HF Qwen3-VL vision towers built and saved locally (no hub), and grid helpers."""

from __future__ import annotations

import atexit
import copy
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Four CPU devices, so data parallelism runs on a real multi-device client (the default device is still one).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import numpy as np
import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.image_utils import PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

import vitjax
import vitjax.notices

# One XLA compilation cache for the run, in a temporary folder removed at its end (none is left in the user's home):
# made by the first process that loads this file (pytest's controller under xdist) and inherited by the workers and
# the SGLang processes the tests start, which compile the same tiny programs many times over.
if "VITJAX_CACHE_DIR" not in os.environ:
    os.environ["VITJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitjax-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["VITJAX_CACHE_DIR"], ignore_errors=True)

# head_dim 64 (like 2B/4B) and 72 (like 8B and larger), deepstack taps at different blocks.
TINY = {
    "hd64": vitjax.VisionConfig(
        depth=3, hidden_size=128, num_heads=2, intermediate_size=96, out_hidden_size=40, deepstack_visual_indexes=(0, 2)
    ),
    "hd72": vitjax.VisionConfig(
        depth=4, hidden_size=144, num_heads=2, intermediate_size=80, out_hidden_size=48, deepstack_visual_indexes=(1, 2)
    ),
}
# The files that start real SGLang engines and servers, and the multi-device one, longest first: they are handed to
# xdist's workers first and the short files fill in around them.
LONGEST_FIRST = ("test_bridge_sglang.py", "test_bridge_server.py", "test_bridge_load_formats.py", "test_parallel.py")


def pytest_configure(config: pytest.Config) -> None:
    """Keep this file's order under `--dist loadfile`: xdist (>= 3.8 can be told not to) would otherwise hand
    out the files with the most tests first."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`LONGEST_FIRST` before the other files (a stable sort: the order within a file is kept)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


PHOTOS = sorted((Path(__file__).parent / "data" / "images").glob("*.[jp][pn]g"))
MAX_PIXELS = 128 * 128 * 4  # keeps the CPU tower small in encode tests; the preprocessing tests cover the defaults
# Several images and a t=2 video packed together; non-square grids; a single 2x2 image.
GRIDS = [(1, 6, 8), (2, 4, 10), (1, 2, 2), (1, 12, 4)]


def make_hf(
    patch: int = 16, min_pixels: int = 65536, max_pixels: int = 16777216, backend: str = "pil"
) -> Qwen2VLImageProcessorPil | Qwen2VLImageProcessor:
    """HF's image processor as Qwen3-VL ships it, built locally (nothing from a hub): the PIL one, or with
    `backend="torchvision"` the one `AutoProcessor` builds."""
    processor = Qwen2VLImageProcessorPil if backend == "pil" else Qwen2VLImageProcessor
    return processor(
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        resample=PILImageResampling.BICUBIC,
        do_convert_rgb=True,
    )


def hf_vision_config(cfg: vitjax.VisionConfig) -> Qwen3VLVisionConfig:
    fields = dataclasses.asdict(cfg)
    fields["deepstack_visual_indexes"] = list(cfg.deepstack_visual_indexes)
    fields["rope_parameters"] = {"rope_type": "axial", "rope_theta": fields.pop("rope_theta")}
    return Qwen3VLVisionConfig(**fields)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """HF's init leaves LayerNorms at identity and biases at zero; perturb everything so parity means something."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1 + noise if "norm" in name and name.endswith("weight") else noise)


def hf_vision_model(cfg: vitjax.VisionConfig, seed: int = 0) -> Qwen3VLVisionModel:
    torch.manual_seed(seed)
    model = Qwen3VLVisionModel._from_config(hf_vision_config(cfg), dtype=torch.float32).eval()
    randomize(model, seed)
    return model


def hf_full_model(cfg: vitjax.VisionConfig, seed: int = 0) -> Qwen3VLForConditionalGeneration:
    """A whole (tiny) Qwen3-VL: vision tower under `model.visual.`, plus a language model to be skipped."""
    text = {
        "hidden_size": cfg.out_hidden_size,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 300,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    config = Qwen3VLConfig(vision_config=hf_vision_config(cfg).to_dict(), text_config=text)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    randomize(model.model.visual, seed)
    return model


def pixels_for(grids: list[tuple[int, int, int]], cfg: vitjax.VisionConfig, seed: int = 0) -> np.ndarray:
    tokens = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((tokens, cfg.patch_dim), dtype=np.float32)


def hf_outputs(model: Qwen3VLVisionModel, pixels: np.ndarray, grids) -> np.ndarray:
    """HF's merged output and deepstack features in SGLang's column layout."""
    with torch.no_grad():
        out = model(torch.from_numpy(pixels), grid_thw=torch.tensor(grids))
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1).float().numpy()


def bf16_error_ratio(got: np.ndarray, model: Qwen3VLVisionModel, pixels: np.ndarray, grids) -> float:
    """A bf16 tower's mean abs error against HF fp32 (`model`), over that of HF's own tower run in bf16 (a copy).

    The tests hold bf16 towers to <= 1.5: a right one measures ~1.0, one with a bias or norm left at zero 1.8-3.8,
    where a cosine against fp32 (0.9996-0.9999 for those) would pass it."""
    ref = hf_outputs(model, pixels, grids)
    hf_bf16 = hf_outputs(copy.deepcopy(model).to(torch.bfloat16), pixels, grids)
    mae, hf_mae = float(np.abs(got - ref).mean()), float(np.abs(hf_bf16 - ref).mean())
    print(f"bf16 mean abs error vs HF fp32: {mae:.3g}, HF's own bf16 {hf_mae:.3g}")
    return mae / hf_mae


def assert_close_to_scale(got: np.ndarray, ref: np.ndarray, rel: float = 1e-5) -> None:
    """max |got - ref| <= rel * max |ref|: the tolerance the parity tests are held to."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    assert scale > 0 and err <= rel * scale, f"max abs error {err:.3g} > {rel:g} x output scale {scale:.3g}"


@pytest.fixture(autouse=True)
def no_notices_seen():
    """Each test sees the notices it causes logged, whatever earlier tests in its process logged."""
    vitjax.notices.forget()


@pytest.fixture(scope="session", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    """(config, HF vision model, saved HF directory) for each tiny config."""
    cfg = TINY[request.param]
    model = hf_vision_model(cfg)
    path = tmp_path_factory.mktemp(f"hf-{request.param}")
    model.save_pretrained(path)
    return cfg, model, path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A tiny HF tower saved locally and converted to vitjax's orbax format."""
    from vitjax.weights import convert

    hf_dir = tmp_path_factory.mktemp("hf")
    hf_vision_model(TINY["hd64"]).save_pretrained(hf_dir)
    return convert(hf_dir, tmp_path_factory.mktemp("converted") / "tiny", progress=False)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    """A servable tiny dense Qwen3-VL checkpoint (tokenizer and processors too) for the files that start SGLang."""
    from qwen3vl_checkpoint import build  # it imports this file's helpers

    return build(tmp_path_factory.mktemp("qwen3vl") / "model", TINY["hd64"])
