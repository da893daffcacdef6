"""HF checkpoint loading (prefixes, shards, full models), strict validation, and the orbax converter."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import torch
from conftest import GRIDS, PHOTOS, TINY, assert_close_to_scale, hf_full_model, hf_outputs, hf_vision_model, pixels_for
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import vitjax
from vitjax import weights
from vitjax.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]


def _encode(enc, cfg, grids=GRIDS):
    x = pixels_for(grids, cfg)
    return x, np.concatenate([np.asarray(o) for o in enc.encode_patches(x, np.array(grids))])


@pytest.fixture(scope="module")
def full_model(tmp_path_factory):
    """A whole tiny Qwen3-VL saved in sharded form: vision under `model.visual.`, LM tensors beside it."""
    cfg = TINY["hd64"]
    model = hf_full_model(cfg)
    path = tmp_path_factory.mktemp("hf-full")
    model.save_pretrained(path, max_shard_size="300KB")
    return cfg, model, path


def test_full_sharded_checkpoint_skips_language_model(full_model, monkeypatch):
    cfg, model, path = full_model
    assert (path / weights.INDEX_FILE).is_file() and len(list(path.glob("*.safetensors"))) > 2
    read: list[str] = []
    real_open = weights.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self._f = real_open(*a, **k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def __getattr__(self, name):
            return getattr(self._f, name)

        def get_tensor(self, key):
            read.append(key)
            return self._f.get_tensor(key)

    monkeypatch.setattr(weights, "safe_open", Recording)
    enc = vitjax.Encoder.from_pretrained(path, dtype="float32")
    assert read and all(k.startswith("model.visual.") for k in read)
    assert len(read) == len(weights.weight_map(cfg))
    assert enc.num_params == sum(p.numel() for p in model.model.visual.parameters())
    x, got = _encode(enc, cfg)
    assert_close_to_scale(got, hf_outputs(model.model.visual, x, GRIDS))


def test_a_quantized_language_model_beside_an_unquantized_tower_loads(full_model, tmp_path):
    """A block-FP8 Qwen3-VL whose vision tower stays bf16: language-model weights as FP8 codes with their
    `weight_scale_inv`, a `quantization_config` whose `modules_to_not_convert` names the tower. vitjax reads the
    tower alone, as stored."""
    cfg, model, _ = full_model
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for key in [k for k in tensors if k.startswith("model.language_model.") and k.endswith("proj.weight")]:
        tensors[key] = tensors[key].to(torch.float8_e4m3fn)
        tensors[f"{key}_scale_inv"] = torch.ones(-(-tensors[key].shape[0] // 128), -(-tensors[key].shape[1] // 128))
    tensors = {k: v.to(torch.bfloat16) if k.startswith("model.visual.") else v for k, v in tensors.items()}
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.visual", "lm_head"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    enc = vitjax.Encoder.from_pretrained(tmp_path, dtype="float32")
    x, got = _encode(enc, cfg)
    visual = copy.deepcopy(model.model.visual)
    for param in visual.parameters():  # the weights as stored (buffers are not weights)
        param.data = param.data.to(torch.bfloat16).to(torch.float32)
    assert_close_to_scale(got, hf_outputs(visual, x, GRIDS))


def test_sharded_vision_only_checkpoint(tmp_path):
    """`Qwen3VLVisionModel.save_pretrained` in shards: bare names in the index, every shard the tower's."""
    cfg = TINY["hd64"]
    hf = hf_vision_model(cfg)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / weights.INDEX_FILE).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    x, got = _encode(vitjax.Encoder.from_pretrained(tmp_path, dtype="float32"), cfg)
    assert_close_to_scale(got, hf_outputs(hf, x, GRIDS))


def test_bare_visual_prefix(tiny, tmp_path):
    """Third-party splits name the tower `visual.*`."""
    cfg, hf, path = tiny
    tensors = load_file(path / "model.safetensors")
    save_file({f"visual.{k}": v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    x, got = _encode(vitjax.Encoder.from_pretrained(tmp_path, dtype="float32"), cfg)
    assert_close_to_scale(got, hf_outputs(hf, x, GRIDS))


def _corrupt(tiny, tmp_path, edit):
    cfg, _, path = tiny
    tensors = {f"model.visual.{k}": v for k, v in load_file(path / "model.safetensors").items()}
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    return tmp_path


def test_missing_tensor_is_named(tiny, tmp_path, monkeypatch):
    path = _corrupt(tiny, tmp_path, lambda t: t.pop("model.visual.blocks.1.mlp.linear_fc2.bias"))
    monkeypatch.setattr(weights._Assembler, "add", lambda *_: pytest.fail("a tensor was read first"))  # noqa: SLF001
    with pytest.raises(
        weights.CheckpointError, match=r"1 vision tensors missing: model\.visual\.blocks\.1\.mlp\.linear_fc2\.bias"
    ):
        vitjax.Encoder.from_pretrained(path)


def test_unexpected_tensor_is_named(tiny, tmp_path):
    path = _corrupt(tiny, tmp_path, lambda t: t.update({"model.visual.blocks.99.norm1.weight": torch.ones(3)}))
    with pytest.raises(weights.CheckpointError, match=r"unexpected tensor model\.visual\.blocks\.99\.norm1\.weight"):
        vitjax.Encoder.from_pretrained(path)


def test_misshaped_tensor_is_named(tiny, tmp_path):
    cfg = tiny[0]
    key = "model.visual.merger.linear_fc1.weight"
    path = _corrupt(tiny, tmp_path, lambda t: t.update({key: t[key][:, :-4].contiguous()}))
    wide = cfg.hidden_size * 4
    with pytest.raises(
        weights.CheckpointError, match=rf"tensor {key} has shape \[{wide}, {wide - 4}\], expected \[{wide}, {wide}\]"
    ):
        vitjax.Encoder.from_pretrained(path)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_non_float_tensor_is_named(tiny, tmp_path, dtype):
    """Integer and FP8 tensors (FP8 checkpoints of the tower exist; numpy cannot even read them) before reading."""
    key = "model.visual.blocks.0.attn.qkv.weight"
    path = _corrupt(tiny, tmp_path, lambda t: t.update({key: (t[key] * 100).to(dtype)}))
    stored = {torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3"}[dtype]
    message = rf"tensor {key} has dtype {stored}, expected one of \('F16'"
    with pytest.raises(weights.CheckpointError, match=message) as e:
        vitjax.Encoder.from_pretrained(path)
    assert str(e.value).endswith(weights.QUANTIZED)


def test_fp8_arrays_are_not_taken_as_weights(tiny):
    """8-bit floats are floats to numpy's type tree, but a quantized tower's codes (its scales are other tensors): as
    a first load and as an update (SGLang's weight updates) they are refused by name, and the tower keeps its values."""
    import ml_dtypes

    cfg, _, path = tiny
    named = {k: v.numpy() for k, v in load_file(str(path / "model.safetensors")).items()}
    key = "blocks.0.attn.proj.weight"
    fp8 = {**named, key: named[key].astype(ml_dtypes.float8_e4m3fn)}
    message = rf"at: tensor {key} has dtype float8_e4m3fn, expected one of float16, bfloat16, float32, float64 \("
    with pytest.raises(weights.CheckpointError, match=message):
        weights.from_named_arrays(fp8.items(), cfg, "at")
    base = weights.from_named_arrays(named.items(), cfg, "at")
    before = jax.tree.map(np.array, base)
    with pytest.raises(weights.CheckpointError, match=message):
        weights.from_named_arrays([(key, fp8[key])], cfg, "at", base=base)
    jax.tree.map(np.testing.assert_array_equal, base, before)  # the refused update changed nothing
    with pytest.raises(weights.CheckpointError, match="has dtype float8_e4m3fn"):
        vitjax.Encoder.from_params(cfg, jax.tree.map(lambda x: x.astype(ml_dtypes.float8_e4m3fn), base))


def test_blocks_stored_in_several_dtypes_keep_each_value(tiny, tmp_path):
    """One block's tensor in bf16, the rest fp32: HF keeps every fp32 value; the stacked leaf used to take the
    first block's bf16 and round all the others (5.5e-4 off HF in fp32)."""
    cfg, shared, _ = tiny
    hf = copy.deepcopy(shared)  # the session's fixture stays the checkpoint's model for the other tests
    key = "model.visual.blocks.0.norm1.weight"
    path = _corrupt(tiny, tmp_path, lambda t: t.update({key: t[key].to(torch.bfloat16)}))
    x, got = _encode(vitjax.Encoder.from_pretrained(path, dtype="float32"), cfg)
    with torch.no_grad():
        hf.blocks[0].norm1.weight.copy_(hf.blocks[0].norm1.weight.to(torch.bfloat16).float())
    assert_close_to_scale(got, hf_outputs(hf, x, GRIDS))


def test_unreadable_index_is_named(tmp_path, capsys):
    cfg = TINY["hd64"]
    hf_vision_model(cfg).save_pretrained(tmp_path, max_shard_size="100KB")
    index = tmp_path / weights.INDEX_FILE
    for damaged in (
        '{"weight_map": null}',
        '{"weight_map": {"model.visual.x": 3}}',
        '{"metadata": {}}',  # no weight_map: it is not "no vision tensors"
        '{"weight_map": {}}',
    ):
        index.write_text(damaged)
        with pytest.raises(weights.CheckpointError, match=rf"^{index}: not a readable index \(its weight_map must map"):
            vitjax.Encoder.from_pretrained(tmp_path)
    index.write_text("{not json")
    with pytest.raises(weights.CheckpointError, match=rf"^{index}: not a readable index \(Expecting property"):
        vitjax.Encoder.from_pretrained(tmp_path)
    out = tmp_path / "out.safetensors"
    assert cli_main(["encode", str(PHOTOS[0]), "--model", str(tmp_path), "-o", str(out)]) == 2
    assert f"{index}: not a readable index" in capsys.readouterr().err and not out.exists()


def test_unreadable_file_is_named(tiny, tmp_path):
    path = _corrupt(tiny, tmp_path, lambda t: None)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(weights.CheckpointError, match=rf"{file}: not a readable safetensors file"):
        vitjax.Encoder.from_pretrained(path)


def test_foreign_and_empty_checkpoints(tiny, tmp_path):
    path = _corrupt(tiny, tmp_path, lambda t: t.update({"thinker.visual.merger.ln_q.weight": torch.ones(3)}))
    with pytest.raises(weights.CheckpointError, match=r"thinker\.visual\.merger\.ln_q\.weight belongs to a different"):
        vitjax.Encoder.from_pretrained(path)
    save_file({"model.language_model.norm.weight": torch.ones(4)}, tmp_path / "model.safetensors")
    with pytest.raises(weights.CheckpointError, match="no vision tower tensors"):
        vitjax.Encoder.from_pretrained(tmp_path)


def test_config_mismatch_is_named(tiny, tmp_path):
    """A checkpoint with more blocks than its config says: the extra block's tensors are named."""
    cfg, _, path = tiny
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    smaller = {**cfg.to_hf(), "depth": cfg.depth - 1, "deepstack_visual_indexes": [0]}
    (other / "config.json").write_text(json.dumps(smaller))
    n = cfg.depth - 1
    with pytest.raises(weights.CheckpointError, match=rf"unexpected tensor blocks\.{n}\.\S+ for a {n}-block tower"):
        vitjax.Encoder.from_pretrained(other)


def test_converter_round_trip(full_model, tmp_path):
    """HF dir -> orbax (CLI and script) -> Encoder gives exactly what loading HF directly gives."""
    cfg, _, path = full_model
    direct = _encode(vitjax.Encoder.from_pretrained(path, dtype="float32"), cfg)[1]
    assert cli_main(["convert", str(path), str(tmp_path / "cli"), "--quiet"]) == 0
    script = subprocess.run(
        [sys.executable, str(REPO / "checkpoints" / "convert_hf.py"), str(path), str(tmp_path / "script")],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert script.returncode == 0, script.stderr
    for out in ("cli", "script"):
        assert weights.is_orbax(tmp_path / out)
        enc = vitjax.Encoder.from_pretrained(tmp_path / out, dtype="float32")
        assert enc.cfg == cfg
        np.testing.assert_array_equal(_encode(enc, cfg)[1], direct)


def test_convert_writes_whole_or_nothing_and_refuses_what_it_cannot_use(full_model, tmp_path, capsys, monkeypatch):
    cfg, _, path = full_model

    def refused(source, out, message):
        assert cli_main(["convert", str(source), str(out), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("vitjax: error: convert ") and message in err, err

    source_config = (path / "config.json").read_text()
    refused(path, path, "is the checkpoint being converted")
    assert (path / "config.json").read_text() == source_config
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    refused(path, other, "exists and is not a converted checkpoint")
    (other / weights.ORBAX_PARAMS).mkdir()  # a params/ folder beside other files is not a conversion either
    refused(path, other, "exists and is not a converted checkpoint")
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt", "params"]
    qwen2 = tmp_path / "qwen2"
    qwen2.mkdir()
    (qwen2 / "config.json").write_text(json.dumps({**json.loads(source_config), "model_type": "qwen2_vl"}))
    refused(qwen2, tmp_path / "out", "is not a Qwen3-VL model")
    for source in (tmp_path / "nowhere", path / "config.json"):  # a file is no checkpoint either, whatever it holds
        refused(source, tmp_path / "out", f"{source}: not a folder (an HF checkpoint is one: config.json and")
    real_save = weights.save_orbax

    def interrupted(out_dir, *args):
        real_save(out_dir, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(weights, "save_orbax", interrupted)
    with pytest.raises(KeyboardInterrupt):
        weights.convert(path, tmp_path / "out", progress=False)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "qwen2"]  # nothing half-written, nothing left
    # staging folders of conversions killed (SIGKILL, out of memory) go at a later one once a day old, not sooner
    killed, recent = (tmp_path / weights.STAGING_PATTERN.replace("*", tag) for tag in ("dead0000", "busy0000"))
    for staging in (killed, recent):
        (staging / weights.ORBAX_PARAMS).mkdir(parents=True)
    day_ago = time.time() - weights.STALE_STAGING_SECONDS - 1
    os.utime(killed, (day_ago, day_ago))
    for _ in range(2):  # a conversion, then one over it
        assert cli_main(["convert", str(path), str(tmp_path / "out"), "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [recent.name, "other", "out", "qwen2"]
    shutil.rmtree(recent)
    assert vitjax.Encoder.from_pretrained(tmp_path / "out").cfg == cfg
    (tmp_path / "link").symlink_to("out")  # a link to an earlier conversion: its target is replaced, the link stays
    before = (tmp_path / "out" / "config.json").stat().st_ino
    assert cli_main(["convert", str(path), str(tmp_path / "link"), "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "other", "out", "qwen2"]
    assert os.readlink(tmp_path / "link") == "out" and (tmp_path / "out" / "config.json").stat().st_ino != before
    assert vitjax.Encoder.from_pretrained(tmp_path / "link").cfg == cfg


def test_sigterm_leaves_no_partial_conversion(full_model, tmp_path, capsys, monkeypatch):
    """A real SIGTERM while the conversion is written: the staging folder goes, as for Ctrl-C; status 143. Orbax
    writes from background threads that go on after the signal (their files outlived the folder's removal, 4 runs
    in 6 of an 8B-sized conversion): the removal waits for the save to end."""
    path = full_model[2]
    real_save = weights.save_orbax

    def terminated_while_saving(out_dir, *args):
        real_save(out_dir, *args)
        assert any(Path(out_dir).iterdir())  # something half-written is there to clean up

        def late_writes() -> None:  # as orbax's commit threads do
            for i in range(20):
                (Path(out_dir) / f"late-{i}").write_bytes(b"x")
                time.sleep(0.02)

        writer = threading.Thread(target=late_writes)
        writer.start()
        os.kill(os.getpid(), signal.SIGTERM)
        writer.join()

    monkeypatch.setattr(weights, "save_orbax", terminated_while_saving)
    previous = signal.getsignal(signal.SIGTERM)
    assert cli_main(["convert", str(path), str(tmp_path / "out"), "--quiet"]) == 143
    assert capsys.readouterr().err == "vitjax: terminated\n"
    assert list(tmp_path.iterdir()) == [] and signal.getsignal(signal.SIGTERM) == previous


def test_an_interrupt_during_the_save_is_raised_once_the_save_ends():
    """`weights._uninterrupted`: the work's result, its own failure, or an interrupt that came meanwhile, raised after
    the work ended, also when the work then fails (that failure as its cause)."""
    assert weights._uninterrupted(lambda: 42) == 42
    ended = []

    def save(fail: bool):
        time.sleep(0.2)  # the caller is waiting by now
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the handler raises in the waiting thread meanwhile
        ended.append(fail)
        if fail:
            raise OSError("disk full")

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as Python handles it
    try:
        with pytest.raises(KeyboardInterrupt):
            weights._uninterrupted(lambda: save(False))
        with pytest.raises(KeyboardInterrupt) as raised:
            weights._uninterrupted(lambda: save(True))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ended == [False, True] and isinstance(raised.value.__cause__, OSError)


def test_converted_checkpoint_is_held_to_its_config(full_model, tmp_path):
    """A converted directory whose config.json no longer fits its parameters is refused by name, not encoded."""
    cfg, _, path = full_model
    out = weights.convert(path, tmp_path / "conv", progress=False)
    config = json.loads((out / "config.json").read_text())
    params = out / weights.ORBAX_PARAMS
    out_hidden, wide, depth = cfg.out_hidden_size, 4 * cfg.hidden_size, cfg.depth
    edits = {  # field: (value, the first leaf that no longer fits, in the tree's order)
        "out_hidden_size": (
            out_hidden + 8,
            rf"linear_fc2/bias has shape \[2, {out_hidden}\], expected \[2, {out_hidden + 8}\]",
        ),
        "deepstack_visual_indexes": ([0], rf"linear_fc1/bias has shape \[2, {wide}\], expected \[1, {wide}\]"),
        "depth": (
            depth + 1,
            rf"blocks/attn/proj/bias has shape \[{depth}, {cfg.hidden_size}\], expected \[{depth + 1}, ",
        ),
    }
    for field, (value, message) in edits.items():
        (out / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(weights.CheckpointError, match=rf"{params}: parameter \S*{message}"):
            vitjax.Encoder.from_pretrained(out)
    (out / "config.json").write_text(json.dumps(config))
    (params / "_METADATA").write_text("")
    with pytest.raises(weights.CheckpointError, match=rf"{params}: not a readable converted checkpoint"):
        vitjax.Encoder.from_pretrained(out)
    (params / "_METADATA").write_text("{}")  # JSON, but without the keys orbax looks up
    with pytest.raises(weights.CheckpointError, match=rf"^{params}: not a readable converted checkpoint \(KeyError: "):
        vitjax.Encoder.from_pretrained(out)


def test_damaged_converted_checkpoint(full_model, tmp_path, monkeypatch):
    """Array data cut short: a short error naming the converted folder and the damaged file (not tensorstore's
    kilobyte of spec), and the reads tensorstore completes afterwards on orbax's closed event loop report nothing
    through `sys.unraisablehook`, while any other unraisable error still reaches it."""
    cfg, _, path = full_model
    out = weights.convert(path, tmp_path / "conv", progress=False)
    data = next((out / weights.ORBAX_PARAMS / "d").iterdir())
    data.write_bytes(data.read_bytes()[:100])
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    with pytest.raises(weights.CheckpointError) as caught:
        vitjax.Encoder.from_pretrained(out)
    message = str(caught.value)
    assert message.startswith(f"{out / weights.ORBAX_PARAMS}: not a readable converted checkpoint (")
    assert data.name in message and "tensorstore_spec" not in message and len(message) < 600, message
    closed, other = (
        SimpleNamespace(exc_value=e, object=None) for e in (RuntimeError("Event loop is closed"), KeyError())
    )
    before = len(seen)
    sys.unraisablehook(closed)
    sys.unraisablehook(other)
    assert seen[before:] == [other]


def test_convert_to_a_long_name(full_model, tmp_path):
    """An output name of 248 characters (the limit is 255): the staging folder's name must not be longer."""
    cfg, _, path = full_model
    out = tmp_path / ("c" * 248)
    assert weights.convert(path, out, progress=False) == out
    assert [p.name for p in tmp_path.iterdir()] == [out.name] and vitjax.Encoder.from_pretrained(out).cfg == cfg


# --- models named by hub id (`vitjax.hub`), from a Hugging Face cache as huggingface_hub keeps one --------------------

HUB_REPO = "vitjax-tests/tiny-qwen3-vl"


def _cached(hub: Path, repo: str, files: dict[str, bytes]) -> Path:
    """`repo` in a Hugging Face cache at `hub` as huggingface_hub keeps one (refs/main naming a snapshot folder),
    holding `files`; returns the snapshot folder."""
    commit = "3f1c" * 10
    folder = hub / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot


@pytest.fixture
def hub_cache(full_model, tmp_path, monkeypatch):
    """An offline Hugging Face cache holding `HUB_REPO`, the full model sharded as released checkpoints are (the
    language model's tensors in shards of their own), with only what `vitjax.hub` fetches: config, index and the
    vision shard. Returns the snapshot folder."""
    import huggingface_hub.constants

    _, _, path = full_model
    tensors = {}
    for shard in set(json.loads((path / weights.INDEX_FILE).read_text())["weight_map"].values()):
        tensors.update(load_file(path / shard))
    vision = {k: v for k, v in tensors.items() if k.startswith("model.visual.")}
    names = {k: f"model-0000{1 if k in vision else 2}-of-00002.safetensors" for k in tensors}
    index = json.dumps({"metadata": {}, "weight_map": names}).encode()
    config = (path / "config.json").read_bytes()
    snapshot = _cached(tmp_path / "hub", HUB_REPO, {"config.json": config, weights.INDEX_FILE: index})
    save_file(vision, snapshot / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    assert weights.vision_shards(snapshot / weights.INDEX_FILE) == ["model-00001-of-00002.safetensors"]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_hub_id_loads_its_vision_shards_from_the_cache(full_model, hub_cache, tmp_path, capsys):
    """A sharded full model (its vision shard only in the cache), and an unsharded one (one model.safetensors)."""
    cfg, _, path = full_model
    enc = vitjax.Encoder.from_pretrained(HUB_REPO, dtype="float32")
    assert enc.model_id == f"{hub_cache.resolve()}:float32"
    assert np.array_equal(_encode(enc, cfg)[1], _encode(vitjax.Encoder.from_pretrained(path, dtype="float32"), cfg)[1])
    out = tmp_path / "out.safetensors"
    argv = ["encode", str(PHOTOS[0]), "--model", HUB_REPO, "--max-pixels", "65536", "--quiet", "-o", str(out)]
    assert cli_main(argv) == 0
    with safe_open(out, "np") as f:
        assert json.loads(f.metadata()["vitjax"])["model"] == str(hub_cache.resolve())
    assert cli_main(["convert", HUB_REPO, str(tmp_path / "conv"), "--quiet"]) == 0
    assert vitjax.Encoder.from_pretrained(tmp_path / "conv").cfg == cfg
    single = {"config.json": (hub_cache / "config.json").read_bytes()}
    single["model.safetensors"] = (hub_cache / "model-00001-of-00002.safetensors").read_bytes()
    one_file = _cached(tmp_path / "hub", "vitjax-tests/one-file", single)
    enc = vitjax.Encoder.from_pretrained("vitjax-tests/one-file", dtype="float32")
    assert enc.model_id == f"{one_file.resolve()}:float32"
    assert np.array_equal(_encode(enc, cfg)[1], _encode(vitjax.Encoder.from_pretrained(path, dtype="float32"), cfg)[1])


def test_a_hub_id_the_hub_does_not_give_is_named(full_model, hub_cache, tmp_path, capsys, monkeypatch):
    """Offline and not cached (or cached in part): an OSError naming the id, one usage line from the CLI (exit 2); an
    index the hub gave that is none is named too. A folder here of that name is the model, as in transformers, and a
    path under a folder here is a path (no hub asked: it is not there)."""
    refused = ": not a folder here, and the Hugging Face Hub did not give it ("
    config = (hub_cache / "config.json").read_bytes()
    _cached(tmp_path / "hub", "vitjax-tests/config-only", {"config.json": config})
    for missing in ("vitjax-tests/not-cached", "vitjax-tests/config-only"):
        with pytest.raises(OSError) as caught:
            vitjax.Encoder.from_pretrained(missing)
        assert str(caught.value).startswith(missing + refused)
        assert cli_main(["encode", str(PHOTOS[0]), "--model", missing, "-o", str(tmp_path / "x.safetensors")]) == 2
        assert cli_main(["convert", missing, str(tmp_path / "conv")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith(f"vitjax: error: --model {missing}{refused}")
        assert lines[1].startswith(f"vitjax: error: convert {missing} {tmp_path / 'conv'}: {missing}{refused}")
        assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "conv").exists()
    # The checks before any weight: a model that is not Qwen3-VL's (its config cached, no weights) is named as such.
    llama = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}).encode()
    _cached(tmp_path / "hub", "vitjax-tests/llama", {"config.json": llama})
    assert cli_main(["convert", "vitjax-tests/llama", str(tmp_path / "conv")]) == 2
    assert "model_type 'llama' is not a Qwen3-VL model" in capsys.readouterr().err
    broken = {"config.json": config, weights.INDEX_FILE: b"{not json"}
    index = _cached(tmp_path / "hub", "vitjax-tests/broken-index", broken) / weights.INDEX_FILE
    assert cli_main(["encode", str(PHOTOS[0]), "--model", "vitjax-tests/broken-index", "-o", "x.safetensors"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"vitjax: error: --model vitjax-tests/broken-index: {index}: not a readable index (")
    assert "Traceback" not in error and len(error.splitlines()) == 1
    monkeypatch.chdir(tmp_path)
    here = tmp_path / HUB_REPO
    here.parent.mkdir()
    here.symlink_to(full_model[2])
    assert vitjax.Encoder.from_pretrained(HUB_REPO).model_id == f"{full_model[2].resolve()}:bfloat16"
    assert cli_main(["encode", str(PHOTOS[0]), "--model", "vitjax-tests/typo", "-o", "x.safetensors"]) == 2
    assert "--model vitjax-tests/typo: no such directory" in capsys.readouterr().err
