"""VisionConfig presets and HF config parsing; every preset's parameter count equals HF's."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import pytest
import torch
from conftest import hf_vision_config
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

import vitjax
from vitjax.config import PRESETS
from vitjax.encoder import abstract_tower

# From the released models' config.json (see shared/reference/qwen3vl-spec.md, section 2).
EXPECTED = {
    "qwen3-vl-2b": (24, 1024, 4096, 2048, (5, 11, 17)),
    "qwen3-vl-4b": (24, 1024, 4096, 2560, (5, 11, 17)),
    "qwen3-vl-8b": (27, 1152, 4304, 4096, (8, 16, 24)),
    "qwen3-vl-32b": (27, 1152, 4304, 5120, (8, 16, 24)),
    "qwen3-vl-30b-a3b": (27, 1152, 4304, 2048, (8, 16, 24)),
    "qwen3-vl-235b-a22b": (27, 1152, 4304, 4096, (8, 16, 24)),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_values_and_param_count(name):
    cfg = vitjax.VisionConfig.preset(name)
    assert (cfg.depth, cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size, cfg.deepstack_visual_indexes) == (
        EXPECTED[name]
    )
    ours = sum(int(p.size) for p in _leaves(abstract_tower(cfg, jnp.bfloat16)))
    with torch.device("meta"):
        hf = Qwen3VLVisionModel(hf_vision_config(cfg))
    assert ours == sum(p.numel() for p in hf.parameters())


def _leaves(model):
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_known_param_count_8b():
    """576.4M parameters for the 8B tower (the published 'ViT 576.4M')."""
    cfg = vitjax.VisionConfig.preset("8b")
    assert round(sum(int(p.size) for p in _leaves(abstract_tower(cfg, jnp.bfloat16))) / 1e6, 1) == 576.4


def test_preset_names():
    assert set(PRESETS) == set(EXPECTED)
    assert vitjax.VisionConfig.preset("Qwen3-VL-8B") is PRESETS["qwen3-vl-8b"]
    assert vitjax.VisionConfig.preset_name("Qwen/Qwen3-VL-30B_A3B") == "qwen3-vl-30b-a3b"
    assert vitjax.VisionConfig.preset_name("2B") == "qwen3-vl-2b"
    with pytest.raises(ValueError, match="unknown preset 'qwen3-vl-7b'"):
        vitjax.VisionConfig.preset("qwen3-vl-7b")


def test_from_hf_full_and_vision_only(tmp_path):
    vision = hf_vision_config(PRESETS["qwen3-vl-4b"]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": vision}))
    assert vitjax.VisionConfig.from_hf(tmp_path) == PRESETS["qwen3-vl-4b"]
    assert vitjax.VisionConfig.from_hf(vision) == PRESETS["qwen3-vl-4b"]
    assert vitjax.VisionConfig.from_hf(PRESETS["qwen3-vl-8b"].to_hf()) == PRESETS["qwen3-vl-8b"]


def test_from_hf_errors(tmp_path):
    with pytest.raises(ValueError, match="model_type 'qwen2_5_vl' is not a Qwen3-VL model"):
        vitjax.VisionConfig.from_hf({"model_type": "qwen2_5_vl", "vision_config": {}})
    vision = PRESETS["qwen3-vl-2b"].to_hf()
    del vision["out_hidden_size"]
    with pytest.raises(ValueError, match=r"lacks \['out_hidden_size'\]"):
        vitjax.VisionConfig.from_hf(vision)
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        vitjax.VisionConfig.from_hf({**PRESETS["qwen3-vl-2b"].to_hf(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes \[30\] are outside the 24 blocks"):
        vitjax.VisionConfig.from_hf({**PRESETS["qwen3-vl-2b"].to_hf(), "deepstack_visual_indexes": [5, 30]})
    with pytest.raises(ValueError, match=r"spatial_merge_size 3 is not supported \(Qwen3-VL merges 2x2\)"):
        vitjax.VisionConfig.from_hf({**PRESETS["qwen3-vl-2b"].to_hf(), "spatial_merge_size": 3})
    for unordered in ([17, 5, 11], [5, 5, 11]):
        with pytest.raises(ValueError, match=rf"deepstack_visual_indexes \{unordered} must be ascending"):
            vitjax.VisionConfig.from_hf({**PRESETS["qwen3-vl-2b"].to_hf(), "deepstack_visual_indexes": unordered})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        vitjax.VisionConfig.from_hf(tmp_path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"depth": "3"}, "depth must be a positive integer, got '3'"),
        ({"hidden_size": 1152.0}, "hidden_size must be a positive integer, got 1152.0"),
        ({"num_heads": 0}, "num_heads must be a positive integer, got 0"),
        ({"in_channels": True}, "in_channels must be a positive integer, got True"),
        ({"patch_size": None}, "patch_size must be a positive integer, got None"),
        ({"deepstack_visual_indexes": 5}, "deepstack_visual_indexes must be a list of block numbers, got 5"),
        ({"deepstack_visual_indexes": ["5"]}, r"deepstack_visual_indexes must be a list of block numbers, got \['5'\]"),
        ({"rope_parameters": "x"}, "rope_parameters must be a JSON object, got 'x'"),
        ({"rope_parameters": {"rope_type": "axial", "rope_theta": "big"}}, "rope_theta must be a positive number"),
    ],
)
def test_from_hf_refuses_wrong_types_by_field_and_file(tmp_path, edit, message):
    """A field of the wrong type or out of range is a ValueError naming it and the file, not a TypeError deep inside."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PRESETS["qwen3-vl-8b"].to_hf(), **edit}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message}"):
        vitjax.VisionConfig.from_hf(tmp_path)
    with pytest.raises(ValueError, match=rf"^config dict: {message}"):
        vitjax.VisionConfig.from_hf(
            {"model_type": "qwen3_vl", "vision_config": {**PRESETS["qwen3-vl-8b"].to_hf(), **edit}}
        )


def test_from_hf_refuses_what_is_no_json_object(tmp_path):
    path = tmp_path / "config.json"
    for data, message in [
        (b"[1, 2]", "expected a JSON object, got list"),
        (b'{"vision_config": [1]}', "vision_config must be a JSON object, got list"),
        (b'{"depth": 3,', r"not a JSON config \(Expecting property name"),
        (b'{"depth": "\xff"}', r"not a JSON config \('utf-8' codec can't decode byte 0xff"),
    ]:
        path.write_bytes(data)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message}"):
            vitjax.VisionConfig.from_hf(path)
