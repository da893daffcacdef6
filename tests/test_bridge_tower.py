"""`bridge.JaxVisionTower` (SGLang's tower contract, torch in and out) against HF's `Qwen3VLVisionModel`."""

from __future__ import annotations

import logging
import re
import warnings

import jax
import numpy as np
import pytest
import torch
from conftest import (
    GRIDS,
    TINY,
    assert_close_to_scale,
    bf16_error_ratio,
    hf_full_model,
    hf_outputs,
    hf_vision_model,
    pixels_for,
)
from safetensors.torch import load_file

import bridge
import vitjax
from bridge import backend, dlpack
from vitjax.buckets import FIT_GRANULE, Bucket, BucketPolicy
from vitjax.weights import CheckpointError


def test_tower_equals_hf_on_images_and_a_video(tiny):
    cfg, hf, path = tiny
    tower = bridge.JaxVisionTower(vitjax.Encoder.from_pretrained(path, dtype="float32"))
    assert (tower.device, tower.dtype) == (torch.device("cpu"), torch.float32)
    assert tower.spatial_merge_size == 2 and tower.out_hidden_size == cfg.out_hidden_size * (
        1 + len(cfg.deepstack_visual_indexes)
    )
    assert tower.deepstack_visual_indexes == list(cfg.deepstack_visual_indexes)
    pixels = pixels_for(GRIDS, cfg)
    ref = hf_outputs(hf, pixels, GRIDS)
    out = tower(torch.from_numpy(pixels), torch.tensor(GRIDS))  # SGLang: grid_thw a CPU long tensor
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.device.type == "cpu"
    assert_close_to_scale(out.numpy(), ref)
    # The DP encoder path passes grid_thw positionally, sometimes as a list of lists.
    assert_close_to_scale(tower(torch.from_numpy(pixels), [list(g) for g in GRIDS]).numpy(), ref)
    assert (tower.calls, tower.items) == (2, 2 * len(GRIDS))


def test_a_call_that_fails_after_the_tower_ran_is_not_counted(tiny, monkeypatch):
    """Copying the features out can still fail (CUDA out of memory): that call was not served, so not counted."""
    cfg, _, path = tiny
    tower = bridge.JaxVisionTower(vitjax.Encoder.from_pretrained(path, dtype="float32"))

    def out_of_memory(array):
        raise torch.OutOfMemoryError("CUDA out of memory copying the features")

    with monkeypatch.context() as m:
        m.setattr(bridge.tower.dlpack, "to_torch", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            tower(torch.from_numpy(pixels_for(GRIDS, cfg)), torch.tensor(GRIDS))
    assert (tower.calls, tower.items) == (0, 0)
    tower(torch.from_numpy(pixels_for(GRIDS, cfg)), torch.tensor(GRIDS))
    assert (tower.calls, tower.items) == (1, len(GRIDS))


def test_features_own_their_memory_and_no_combination_of_sizes_compiles(tiny, monkeypatch, request):
    """The features are a tensor of their own (SGLang's cache counts a tensor's own bytes: a view of a call's padded
    output would keep all of it alive uncounted), made without a JAX program per combination of image sizes."""
    cfg, _, path = tiny
    tower = bridge.JaxVisionTower(vitjax.Encoder.from_pretrained(path, dtype="float32"))
    encode, seen = tower.encoder.encode_patches, []
    monkeypatch.setattr(tower.encoder, "encode_patches", lambda *a: seen.append(encode(*a)) or seen[-1])
    compiles = []

    def listen(event, _, **__):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    request.addfinalizer(lambda: jax.monitoring.unregister_event_duration_listener(listen))
    small = [(1, 2, 2)]  # 1 output row in a bucket of many
    out = tower(torch.from_numpy(pixels_for(small, cfg)), torch.tensor(small))
    assert out.shape == (1, tower.out_hidden_size)
    assert out.data_ptr() != seen[-1][0].unsafe_buffer_pointer()
    tower(torch.from_numpy(pixels_for([(1, 4, 4), (1, 2, 4)], cfg)), torch.tensor([(1, 4, 4), (1, 2, 4)]))
    compiles.clear()
    for grids in ([(1, 4, 4), (1, 2, 2)], [(1, 2, 6), (1, 2, 4), (1, 2, 2)]):  # new sizes in the same bucket
        both = tower(torch.from_numpy(pixels_for(grids, cfg)), torch.tensor(grids))
        alone = [np.asarray(o) for o in seen[-1]]
        np.testing.assert_array_equal(both.numpy(), np.concatenate(alone))
    assert compiles == []


def test_tower_loads_sglang_style_named_weights_and_runs_bf16():
    """Weights as SGLang's iterator yields them (torch tensors, full-model names, bf16), into a tower built
    before its weights, as the SGLang model builds it; bf16 output as close to HF's fp32 as HF's own bf16."""
    cfg = TINY["hd72"]
    hf = hf_full_model(cfg, seed=3)
    named = [(k, v.to(torch.bfloat16)) for k, v in hf.state_dict().items() if k.startswith("model.visual.")]
    tower = bridge.JaxVisionTower(config=cfg, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="no weights yet"):
        tower(torch.zeros(16, cfg.patch_dim), torch.tensor([[1, 4, 4]]))
    tower.load(((k, dlpack.to_numpy(v)) for k, v in named), where="test iterator")
    assert next(tower.parameters()).dtype == torch.bfloat16
    grids = [(1, 8, 6), (2, 4, 4)]
    pixels = pixels_for(grids, cfg, seed=1)
    out = tower(torch.from_numpy(pixels).to(torch.bfloat16), torch.tensor(grids))
    assert out.dtype == torch.bfloat16
    assert out.shape == (sum(t * h * w for t, h, w in grids) // 4, tower.out_hidden_size)
    assert bf16_error_ratio(out.float().numpy(), hf.model.visual, pixels, grids) <= 1.5


def test_vision_tensors_a_loader_yields_in_reused_memory_are_kept_whole():
    """SGLang's `--load-format runai_streamer` yields each tensor in memory it reuses for the next one: the model's
    `load_weights` keeps the vision tensors until the language model's are loaded, so it must keep copies."""
    from bridge.sglang_models.qwen3_vl import _VitjaxTower

    class LanguageModel:  # SGLang's class, as far as `load_weights` goes: it takes the other tensors
        def load_weights(self, weights):
            self.language = [name for name, _ in weights]

    class Model(_VitjaxTower, LanguageModel):
        pass

    cfg = TINY["hd64"]
    hf = hf_full_model(cfg, seed=4)
    state = hf.state_dict()
    buffer = torch.empty(max(t.numel() for t in state.values()))

    def streamed():
        for name, tensor in state.items():
            view = buffer[: tensor.numel()].view(tensor.shape)
            view.copy_(tensor)
            yield name, view

    model = Model.__new__(Model)  # SGLang's constructor is not needed here
    model.visual = bridge.JaxVisionTower(config=cfg, device="cpu", dtype=torch.float32)
    model._vitjax_model_id = "streamed"
    model.load_weights(streamed())
    assert model.language == [name for name in state if not name.startswith("model.visual.")]
    pixels = pixels_for(GRIDS, cfg)
    out = model.visual(torch.from_numpy(pixels), torch.tensor(GRIDS))
    assert_close_to_scale(out.numpy(), hf_outputs(hf.model.visual, pixels, GRIDS))


def test_an_fp8_vision_tower_is_refused_by_name():
    """A checkpoint whose vision tower is FP8-quantized (weights as float8 codes, scales as other tensors): SGLang's own
    tower would copy the codes in as values; the bridge refuses it naming the tensor and its dtype, where converting
    the tensor used to raise a TypeError that named nothing. The language model's tensors still went to SGLang."""
    from bridge.sglang_models.qwen3_vl import _VitjaxTower

    class LanguageModel:
        def load_weights(self, weights):
            self.language = [name for name, _ in weights]

    class Model(_VitjaxTower, LanguageModel):
        pass

    cfg = TINY["hd64"]
    state = hf_full_model(cfg, seed=4).state_dict()
    key = "model.visual.blocks.0.mlp.linear_fc1.weight"
    quantized = {**state, key: state[key].to(torch.float8_e4m3fn), f"{key}_scale_inv": torch.ones(1, 1)}
    model = Model.__new__(Model)
    model.visual = bridge.JaxVisionTower(config=cfg, device="cpu", dtype=torch.float32)
    model._vitjax_model_id = "fp8"
    name = key.removeprefix("model.")
    message = rf"tensor {name} has dtype float8_e4m3fn, expected one of .* \(a quantized vision tower\?"
    with pytest.raises(CheckpointError, match=message):
        model.load_weights(iter(quantized.items()))
    assert model.language and model.visual.encoder is None
    np.testing.assert_array_equal(
        dlpack.to_numpy(quantized[key]).astype(np.float32), quantized[key].to(torch.float32).numpy()
    )  # the codes' values, bit for bit: what vitjax's check sees


def test_a_later_load_updates_the_given_tensors_in_place(tiny):
    """SGLang's weight updates reach the tower as loads of some of its tensors: those change, the rest keep
    their values, nothing is compiled again, and a bad tensor leaves the tower as it was."""
    cfg, hf, path = tiny
    other = hf_vision_model(cfg, seed=9).state_dict()
    named = dict(load_file(str(path / "model.safetensors")))
    tower = bridge.JaxVisionTower(config=cfg, device="cpu", dtype=torch.float32)
    tower.load(((k, v.numpy()) for k, v in named.items()), where="ckpt")
    pixels, grids = torch.from_numpy(pixels_for(GRIDS, cfg)), torch.tensor(GRIDS)
    before = tower(pixels, grids).clone()
    encoder, compiles = tower.encoder, tower.encoder.parallel.compiles
    changed = ["blocks.1.mlp.linear_fc1.weight", "blocks.1.mlp.linear_fc1.bias", "merger.norm.weight"]
    tower.load(((f"model.visual.{k}", other[k].numpy()) for k in changed), where="update")
    updated = {**named, **{k: other[k] for k in changed}}
    hf_updated = hf_vision_model(cfg)
    hf_updated.load_state_dict(updated)
    after = tower(pixels, grids)
    assert tower.encoder is encoder and encoder.parallel.compiles == compiles
    assert_close_to_scale(after.numpy(), hf_outputs(hf_updated, pixels.numpy(), GRIDS))
    assert not torch.allclose(after, before)
    with pytest.raises(CheckpointError, match=r"update: tensor merger\.norm\.bias has shape \[3\]"):
        tower.load([("merger.norm.bias", np.zeros(3, np.float32))], where="update")
    assert torch.equal(tower(pixels, grids), after)
    # As stock SGLang updates its own tower (which took the server down before): a name the tower lacks is skipped
    # with a warning, and a tensor sent twice takes its last value.
    norm = other["merger.norm.weight"].numpy()
    sent = [
        ("model.visual.blocks.0.extra.weight", np.zeros(3, np.float32)),
        ("model.visual.merger.norm.weight", np.zeros_like(norm)),
        ("model.visual.merger.norm.weight", norm),
    ]
    with pytest.warns(UserWarning, match=r"^update: tensor model\.visual\.blocks\.0\.extra\.weight is none of the "):
        tower.load(sent, where="update")
    assert torch.equal(tower(pixels, grids), after)


def test_tower_rejects_bad_weights_and_bad_calls_by_name(tiny):
    cfg, _, path = tiny
    named = dict(load_file(str(path / "model.safetensors")))
    tower = bridge.JaxVisionTower(config=cfg, device="cpu", dtype=torch.float32)
    missing = {k: v for k, v in named.items() if k != "merger.linear_fc2.bias"}
    with pytest.raises(CheckpointError, match=r"1 vision tensors missing: merger\.linear_fc2\.bias"):
        tower.load(((k, v.numpy()) for k, v in missing.items()), where="ckpt")
    wrong = {**named, "pos_embed.weight": torch.zeros(3, 3)}
    with pytest.raises(CheckpointError, match=r"pos_embed\.weight has shape \[3, 3\]"):
        tower.load(((k, v.numpy()) for k, v in wrong.items()), where="ckpt")
    tower.load(((k, v.numpy()) for k, v in named.items()), where="ckpt")
    pixels = torch.from_numpy(pixels_for([(1, 4, 4)], cfg))
    with pytest.raises(ValueError, match=r"pixel_values has shape \[16, 1536\], but grid_thw needs \[32, 1536\]"):
        tower(pixels, torch.tensor([[2, 4, 4]]))
    with pytest.raises(ValueError, match=r"divisible by 2"):
        tower(pixels, torch.tensor([[1, 2, 8], [1, 1, 3]]))
    with pytest.raises(ValueError, match=r"grid_thw must be an integer array \[n, 3\], got float64 \[1, 3\]"):
        tower(pixels, torch.tensor([[1.0, 4.0, 4.5]]))
    with pytest.raises(ValueError, match=r"grid_thw must be an integer array \[n, 3\], got int64 \[1, 6\]"):
        tower(torch.cat([pixels, pixels]), torch.tensor([[1, 4, 4, 1, 4, 4]]))
    assert tower.calls == 0


def test_serving_settings_are_read_from_the_environment_and_refused_by_name(monkeypatch):
    """`VITJAX_FIT_GRANULE` and `VITJAX_WARMUP` as SGLang's processes read them; bad values are refused when the
    launcher writes the environment, naming the variable, before SGLang starts."""
    policy = BucketPolicy()
    assert backend.bucket_policy({}).fit_granule == FIT_GRANULE
    assert backend.bucket_policy({backend.FIT_GRANULE_ENV: " 0 "}).fit_granule == 0
    assert backend.bucket_policy({backend.FIT_GRANULE_ENV: "4096"}).fit_granule == 4096
    assert (
        backend.warmup_buckets(policy, {}) is None and backend.warmup_buckets(policy, {"VITJAX_WARMUP": "none"}) == []
    )
    assert backend.warmup_buckets(policy, {"VITJAX_WARMUP": "512,4096"}) == [
        b for b in policy.buckets() if b.tokens in (512, 4096)
    ]
    bad = [
        ({backend.FIT_GRANULE_ENV: "1000.5"}, r"VITJAX_FIT_GRANULE='1000\.5': expected 0 \(off\) or a multiple of 4"),
        ({backend.FIT_GRANULE_ENV: "-4"}, r"VITJAX_FIT_GRANULE='-4'"),
        ({backend.FIT_GRANULE_ENV: "6"}, r"VITJAX_FIT_GRANULE='6'"),
        ({backend.WARMUP_ENV: "500"}, r"VITJAX_WARMUP='500': expected all, none or bucket sizes from \(512, 1024"),
        ({backend.WARMUP_ENV: "big"}, r"VITJAX_WARMUP='big'"),
        # read by the tower once SGLang has loaded the language model, or at its first image: checked up front
        ({"VITJAX_ATTENTION": "bogus"}, r"VITJAX_ATTENTION='bogus': unknown attention implementation 'bogus'"),
        ({backend.TRACE_ENV: "/no/such/dir/t.jsonl"}, r"VITJAX_TRACE='/no/such/dir/t.jsonl': cannot append to it"),
    ]
    for env, message in bad:
        with pytest.raises(ValueError, match=message):
            backend.configure("jax", dict(env))
    assert backend.configure("torch", {backend.FIT_GRANULE_ENV: "6"}) == {backend.BACKEND_ENV: "torch"}

    # The tower builds its encoder with that policy and warms up what was asked.
    cfg = TINY["hd72"]
    named = [(k, v.numpy()) for k, v in hf_vision_model(cfg).state_dict().items()]
    monkeypatch.setenv(backend.FIT_GRANULE_ENV, "0")
    monkeypatch.setenv(backend.WARMUP_ENV, "512")
    tower = bridge.JaxVisionTower(config=cfg, device="cpu", dtype=torch.float32)
    tower.load(named, where="test")
    engine = tower.encoder.parallel.engines[0]
    assert engine.policy.fit_granule == 0 and engine.compiles == 0
    tower.warmup_for_serving()
    assert [k[0] for k in engine._executables] == [Bucket(512, 1), Bucket(512, 4)]  # noqa: SLF001


def test_a_trace_that_cannot_be_written_costs_only_the_trace(tiny, tmp_path, monkeypatch, caplog):
    """`VITJAX_TRACE` gets one line a call; when it cannot be written (a removed folder, a full disk) the call
    still returns its features, with a logged notice (it used to raise out of the tower and end SGLang's scheduler)."""
    cfg, _, path = tiny
    tower = bridge.JaxVisionTower(vitjax.Encoder.from_pretrained(path, dtype="float32"))
    pixels, grids = torch.from_numpy(pixels_for(GRIDS[:1], cfg)), torch.tensor(GRIDS[:1])
    monkeypatch.setenv(backend.TRACE_ENV, str(tmp_path / "trace.jsonl"))
    expected = tower(pixels, grids)
    assert (tmp_path / "trace.jsonl").read_text().count("\n") == 1
    monkeypatch.setenv(backend.TRACE_ENV, str(tmp_path / "gone" / "trace.jsonl"))
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "bridge.tower"):
        warnings.simplefilter("error")  # logged, not warned: `-W error` does not fail the call either
        for _ in range(2):
            assert torch.equal(tower(pixels, grids), expected)
    ((record,),) = [caplog.records]  # once, as a warning would be
    pattern = r"vitjax: VITJAX_TRACE='.*gone/trace.jsonl': not written \(No such file.*\)"
    assert re.fullmatch(pattern, record.getMessage())


def test_dlpack_shares_memory_both_ways():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    x = dlpack.to_jax(t)
    assert x.unsafe_buffer_pointer() == t.data_ptr()
    assert x.dtype.name == "bfloat16" and np.asarray(x, np.float32).tolist() == t.float().tolist()
    back = dlpack.to_torch(x)
    assert back.data_ptr() == x.unsafe_buffer_pointer() and back.dtype == torch.bfloat16
