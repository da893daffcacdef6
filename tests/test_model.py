"""Parity of the Flax tower with HF transformers' Qwen3VLVisionModel, per component and end to end, in fp32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import GRIDS, assert_close_to_scale, bf16_error_ratio, hf_outputs, pixels_for
from flax import nnx
from transformers import vision_utils

import vitjax
from vitjax import layout
from vitjax.attention import Segments
from vitjax.layer_norm import one_pass, pieces, rows_per_program
from vitjax.model import GEMM_WIDTH_MULTIPLE, _LayerNorm, apply_rotary, exact_gelu, rotary_tables
from vitjax.taps import PIECE, in_place, skipping


@pytest.fixture(scope="module")
def loaded(tiny):
    cfg, hf, path = tiny
    enc = vitjax.Encoder.from_pretrained(path, dtype="float32")
    return cfg, hf, enc, nnx.merge(enc._graph, enc._state)


def _packed(cfg, grids):
    packed = layout.pack(grids, side=cfg.grid_side, merge=cfg.spatial_merge_size)
    segments = Segments(*(jnp.asarray(a) for a in packed[3:]))
    return packed, segments


def _block(stacked, i):
    graph, params = nnx.split(stacked)
    return nnx.merge(graph, jax.tree.map(lambda a: a[i], params))


def _hf_rotary(hf, grids, tokens):
    position_ids = vision_utils.get_vision_position_ids(torch.tensor(grids), 2)
    return hf.rotary_pos_emb(torch.zeros(tokens, 1), position_ids)


def _cu_seqlens(grids):
    return vision_utils.get_vision_cu_seqlens(torch.tensor(grids))


def test_patch_embed(loaded):
    cfg, hf, _, model = loaded
    x = pixels_for(GRIDS, cfg)
    with torch.no_grad():
        ref = hf.patch_embed(torch.from_numpy(x)).numpy()
    assert_close_to_scale(np.asarray(model.patch_embed(jnp.asarray(x))), ref)


def test_position_embedding(loaded):
    """Patch embed + interpolated position embedding == HF's input to block 0."""
    cfg, hf, enc, model = loaded
    x = pixels_for(GRIDS, cfg)
    seen = {}
    handle = hf.blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].clone()))
    try:
        hf_outputs(hf, x, GRIDS)
    finally:
        handle.remove()
    packed, segments = _packed(cfg, GRIDS)
    inputs = vitjax.model.TowerInputs(jnp.asarray(packed.pos_index), jnp.asarray(packed.pos_weight), None, segments)
    assert_close_to_scale(np.asarray(model.embed(jnp.asarray(x), inputs)), seen["x"].numpy())


def test_rotary_tables(loaded):
    cfg, hf, _, _ = loaded
    packed, _ = _packed(cfg, GRIDS)
    cos, sin = rotary_tables(jnp.asarray(packed.rope_pos), cfg.head_dim, cfg.rope_theta)
    ref_cos, ref_sin = _hf_rotary(hf, GRIDS, len(packed.rope_pos))
    assert cos.shape == (len(packed.rope_pos), cfg.head_dim)
    np.testing.assert_allclose(np.asarray(cos), ref_cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), ref_sin.numpy(), atol=1e-6)


def test_apply_rotary_matches_hf(loaded):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    cfg, hf, _, _ = loaded
    packed, _ = _packed(cfg, GRIDS)
    cos, sin = rotary_tables(jnp.asarray(packed.rope_pos), cfg.head_dim, cfg.rope_theta)
    q = np.random.default_rng(1).standard_normal((len(packed.rope_pos), cfg.num_heads, cfg.head_dim), np.float32)
    ref, _ = apply_rotary_pos_emb_vision(torch.from_numpy(q), torch.from_numpy(q), *_hf_rotary(hf, GRIDS, len(q)))
    assert_close_to_scale(np.asarray(apply_rotary(jnp.asarray(q), cos, sin)), ref.numpy())


def _block_inputs(cfg, hf, seed=2):
    packed, segments = _packed(cfg, GRIDS)
    cos, sin = rotary_tables(jnp.asarray(packed.rope_pos), cfg.head_dim, cfg.rope_theta)
    h = np.random.default_rng(seed).standard_normal((len(packed.rope_pos), cfg.hidden_size), np.float32)
    return h, cos, sin, segments, _hf_rotary(hf, GRIDS, len(h))


def test_attention(loaded):
    cfg, hf, _, model = loaded
    h, cos, sin, segments, rope = _block_inputs(cfg, hf)
    with torch.no_grad():
        ref = hf.blocks[1].attn(torch.from_numpy(h), cu_seqlens=_cu_seqlens(GRIDS), position_embeddings=rope)
    got = _block(model.blocks, 1).attn(jnp.asarray(h), cos, sin, segments, "reference")
    assert_close_to_scale(np.asarray(got), ref.numpy())


def test_attention_with_a_wider_v_matches_hf(loaded, monkeypatch):
    """V widened as fa4's value-sums schedule wants it (zero weights, a bias of one then zeros), the attention back at
    head_dim for the projection: still HF's attention (run here with XLA's path, which takes any V)."""
    cfg, hf, _, model = loaded
    columns = (1.0,) + (0.0,) * 7
    monkeypatch.setattr("vitjax.model.value_columns", lambda impl, head_dim: columns)
    h, cos, sin, segments, rope = _block_inputs(cfg, hf)
    attn = _block(model.blocks, 1).attn
    _, v = attn.qk_v(jnp.asarray(h), columns)
    assert v.shape == (len(h), cfg.num_heads, cfg.head_dim + 8)
    appended = np.asarray(v[..., cfg.head_dim :])
    np.testing.assert_array_equal(appended, np.broadcast_to(columns, appended.shape))
    with torch.no_grad():
        ref = hf.blocks[1].attn(torch.from_numpy(h), cu_seqlens=_cu_seqlens(GRIDS), position_embeddings=rope)
    assert_close_to_scale(np.asarray(attn(jnp.asarray(h), cos, sin, segments, "reference")), ref.numpy())


def test_mlp_matches_hf_at_the_padded_width(loaded):
    """The hidden width is zero-padded for the GEMMs (the tiny widths are not multiples), the output is HF's."""
    cfg, hf, _, model = loaded
    mlp = _block(model.blocks, 0).mlp
    padded = -(-cfg.intermediate_size // GEMM_WIDTH_MULTIPLE) * GEMM_WIDTH_MULTIPLE
    assert padded > cfg.intermediate_size and mlp.up(jnp.zeros((1, cfg.hidden_size))).shape == (1, padded)
    x = np.random.default_rng(5).standard_normal((24, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        ref = hf.blocks[0].mlp(torch.from_numpy(x))
    assert_close_to_scale(np.asarray(mlp(jnp.asarray(x))), ref.numpy())


@pytest.mark.parametrize("width, dtype", [(1152, jnp.bfloat16), (4608, jnp.bfloat16), (144, jnp.float32)])
def test_one_pass_layer_norm_matches_xla(width, dtype):
    """The GPU LayerNorm's kernel (run by Pallas' interpreter) against XLA's, at the towers' widths; on a CPU
    the model takes XLA's, bit for bit."""
    assert sum(k for _, k in pieces(width)) == width and all(k & (k - 1) == 0 for _, k in pieces(width))
    norm = _LayerNorm(width, dtype, nnx.Rngs(0))
    norm.scale[...] = jax.random.normal(jax.random.key(1), (width,)).astype(dtype)
    norm.bias[...] = jax.random.normal(jax.random.key(2), (width,)).astype(dtype)
    x = (jax.random.normal(jax.random.key(3), (3 * rows_per_program(width), width)) * 3 + 1).astype(dtype)
    ref = np.asarray(norm.xla(x), np.float32)
    got = np.asarray(one_pass(x, norm.scale[...], norm.bias[...], norm.epsilon, interpret=True), np.float32)
    assert_close_to_scale(got, ref, rel=2**-8 if dtype == jnp.bfloat16 else 1e-6)
    np.testing.assert_array_equal(np.asarray(jax.jit(norm)(x)), np.asarray(jax.jit(norm.xla)(x)))


@pytest.mark.parametrize("rows, dtype", [(64, jnp.bfloat16), (3 * 64, jnp.float32)])
def test_tap_write_in_place_matches_dynamic_update(rows, dtype):
    """The GPU tap write's kernel (run by Pallas' interpreter) and XLA's form put a block's output in its slot and
    leave the other slots, and the whole buffer for a block that is no tap (slot K), as they were."""
    taps, width = 3, 2 * PIECE // 64  # rows * width: one program of two pieces, or three programs
    tapped = jax.random.normal(jax.random.key(0), (taps, rows, width)).astype(dtype)
    h = jax.random.normal(jax.random.key(1), (rows, width)).astype(dtype)
    for slot in range(taps + 1):
        want = np.asarray(tapped.at[slot].set(h) if slot < taps else tapped, np.float32)
        for write in (functools.partial(in_place, interpret=True), skipping):
            got = jax.jit(write)(tapped, h, jnp.int32(slot))
            np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_tower_lowers_for_cuda():
    """The program a CUDA GPU compiles, lowered here: the LayerNorm and tap-write kernels are Triton calls (JAX 0.10's
    default Pallas lowering, Mosaic GPU, refuses the LayerNorm's blocks)."""
    cfg = vitjax.VisionConfig(2, 144, 2, 80, 48, (0,))
    graph, state = nnx.split(
        nnx.eval_shape(lambda: vitjax.model.VisionTower(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    )
    packed = layout.pack([(1, 16, 16), (1, 8, 8)], 512, 4, side=cfg.grid_side)
    inputs = vitjax.model.TowerInputs(
        *(jnp.asarray(a) for a in packed[:3]), Segments(*(jnp.asarray(a) for a in packed[3:]))
    )
    pixels = jax.ShapeDtypeStruct((512, cfg.patch_dim), jnp.float32)
    tower = jax.jit(lambda s, p, i: nnx.merge(graph, s)(p, i, "reference"))
    text = tower.trace(state, pixels, inputs).lower(lowering_platforms=("cuda",)).as_text()
    kernels = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    names = [name for line in kernels for name in ("layer_norm_one_pass", "tap_buffer", "tap_write") if name in line]
    # the block's two LayerNorms and tap write (the scan's body, traced once), the final and the deepstack merger's,
    # and the unwritten tap buffer
    assert sorted(names) == ["layer_norm_one_pass"] * 4 + ["tap_buffer", "tap_write"], names


def test_tap_slots_are_written_before_they_are_read(loaded, monkeypatch):
    """On GPUs the tap buffer starts unwritten: a buffer of NaNs instead of zeros changes no output."""
    cfg, _, enc, _ = loaded
    x = pixels_for(GRIDS, cfg)
    want = [np.asarray(o) for o in enc.encode_patches(x, np.array(GRIDS))]
    monkeypatch.setattr(vitjax.model, "tap_buffer", lambda shape, dtype: jnp.full(shape, jnp.nan, dtype))
    nan_start = vitjax.Encoder.from_params(cfg, nnx.to_pure_dict(enc._state), dtype="float32")
    got = [np.asarray(o) for o in nan_start.encode_patches(x, np.array(GRIDS))]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_gelu_matches_torch(dtype):
    """The mergers' GELU is PyTorch's `nn.GELU()` (erf form, fp32 inside), tails and zero included."""
    x = torch.cat([torch.linspace(-12, 12, 20001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 60.0, -60.0])]).to(dtype)
    want = torch.nn.GELU()(x).float().numpy()
    got = np.asarray(exact_gelu(jnp.asarray(x.float().numpy()).astype(jnp.dtype(str(dtype).split(".")[1]))), np.float32)
    if dtype == torch.float32:  # a few fp32 ulp (erf's implementations differ)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    else:  # fp32 values a few ulp apart round to bf16 one step apart at most, and rarely (jax.nn.gelu's erfc form: 32%)
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)
        assert (got != want).mean() < 0.1, (got != want).mean()


@pytest.mark.parametrize("index", [0, -1])
def test_block(loaded, index):
    cfg, hf, _, model = loaded
    h, cos, sin, segments, rope = _block_inputs(cfg, hf)
    index %= cfg.depth
    with torch.no_grad():
        ref = hf.blocks[index](torch.from_numpy(h), cu_seqlens=_cu_seqlens(GRIDS), position_embeddings=rope)
    got = _block(model.blocks, index)(jnp.asarray(h), cos, sin, segments, "reference")
    assert_close_to_scale(np.asarray(got), ref.numpy())


def test_mergers(loaded):
    """The final merger normalizes before the 2x2 shuffle, the deepstack mergers after it."""
    cfg, hf, _, model = loaded
    h = np.random.default_rng(3).standard_normal((64, cfg.hidden_size), np.float32)
    with torch.no_grad():
        ref = hf.merger(torch.from_numpy(h)).numpy()
        refs = [m(torch.from_numpy(h)).numpy() for m in hf.deepstack_merger_list]
    assert_close_to_scale(np.asarray(model.merger(jnp.asarray(h))), ref)
    assert len(refs) == len(cfg.deepstack_visual_indexes) > 0
    for k, r in enumerate(refs):
        assert_close_to_scale(np.asarray(_block(model.deepstack_merger_list, k)(jnp.asarray(h))), r)


@pytest.mark.parametrize(
    "grids",
    [GRIDS, [(1, 2, 2)], [(1, 10, 4), (1, 4, 10)], [(2, 6, 6)]],
    ids=["packed-with-video", "single-2x2", "non-square", "video-t2"],
)
def test_tower_matches_hf(loaded, grids):
    cfg, hf, enc, _ = loaded
    x = pixels_for(grids, cfg, seed=len(grids))
    ref = hf_outputs(hf, x, grids)
    outs = enc.encode_patches(x, np.array(grids))
    assert [o.shape for o in outs] == [(t * h * w // 4, cfg.output_width) for t, h, w in grids]
    assert_close_to_scale(np.concatenate([np.asarray(o) for o in outs]), ref)


def test_video_frames_do_not_attend_to_each_other(loaded):
    """Changing the second temporal group leaves the first group's tokens untouched, and vice versa."""
    cfg, _, enc, _ = loaded
    grid = (2, 4, 6)
    x = pixels_for([grid], cfg)
    y = x.copy()
    y[24:] += 1.0
    a, b = (np.asarray(enc.encode_patches(p, np.array([grid]))[0]) for p in (x, y))
    np.testing.assert_array_equal(a[:6], b[:6])
    assert np.abs(a[6:] - b[6:]).max() > 1e-3


def test_a_nan_image_leaves_the_others_in_its_call_exact(loaded):
    """A caller's pixel rows with a NaN: that image's embeddings are NaN, as HF's are; the images beside it
    in the same call are what they are alone (the reference attention used to spread it through 0 x NaN)."""
    cfg, hf, enc, _ = loaded
    x = pixels_for(GRIDS, cfg)
    x[3, 7] = np.nan  # a row of the first image
    together = [np.asarray(o) for o in enc.encode_patches(x, np.array(GRIDS))]
    n = GRIDS[0][0] * GRIDS[0][1] * GRIDS[0][2]
    ref = hf_outputs(hf, x[:n], GRIDS[:1])
    assert np.isnan(together[0]).all() and np.isnan(ref).all()
    rest = enc.encode_patches(x[n:], np.array(GRIDS[1:]))
    for got, alone in zip(together[1:], rest, strict=True):
        np.testing.assert_allclose(got, np.asarray(alone), atol=1e-5 * float(np.abs(alone).max()))


def test_bfloat16_close_to_hf(loaded):
    """bf16 weights and activations stay near the fp32 oracle (norms, softmax, rotary in fp32): within 1.5x the
    mean error of HF's own tower run in bf16."""
    cfg, hf, _, model = loaded
    x = pixels_for(GRIDS, cfg)
    bf = vitjax.Encoder.from_params(cfg, nnx.to_pure_dict(nnx.state(model)), dtype="bfloat16")
    got = np.concatenate([np.asarray(o, np.float32) for o in bf.encode_patches(x, np.array(GRIDS))])
    assert bf.dtype == jnp.bfloat16
    assert 0 < bf16_error_ratio(got, hf, x, GRIDS) <= 1.5


def test_bad_shapes_are_rejected(loaded):
    cfg, _, enc, _ = loaded
    x = pixels_for([(1, 4, 4)], cfg)
    with pytest.raises(ValueError, match=r"pixel_values has shape \[16, 1536\], but grid_thw needs \[32, 1536\]"):
        enc.encode_patches(x, np.array([[2, 4, 4]]))
    with pytest.raises(ValueError, match="divisible by 2"):
        enc.encode_patches(pixels_for([(1, 3, 4)], cfg), np.array([[1, 3, 4]]))
    with pytest.raises(ValueError, match=r"grid_thw must be an integer array \[n, 3\]"):
        enc.encode_patches(x, np.array([1, 4, 4]))
    # t*h*w past int64 used to wrap to 16 rows and pass, then fail allocating (MemoryError)
    with pytest.raises(ValueError, match=r"but grid_thw needs \[36893488147419103248, 1536\]"):
        enc.encode_patches(x, np.array([[2**61 + 1, 2, 8]]))
    # no numbers, or not real ones: complex pixels lost their imaginary part, strings failed converting unnamed
    for bad in (x.astype(np.complex64), x > 0, x.astype(str), x.astype(object)):
        with pytest.raises(ValueError, match=rf"pixel_values: dtype {bad.dtype}: need real numbers"):
            enc.encode_patches(bad, np.array([[1, 4, 4]]))


def test_apply_rotary_appends_extra_columns():
    """The columns `attention.query_key_columns` asks for come out after the rotated head, exactly, and the rotated
    head is the rotary without them."""
    x = jnp.asarray(np.random.default_rng(6).standard_normal((5, 2, 8)), jnp.bfloat16)
    cos, sin = rotary_tables(jnp.asarray(np.random.default_rng(7).integers(0, 9, (5, 2))), 8, 10000.0)
    wide = np.asarray(apply_rotary(x, cos, sin, (1.0, 0.0)), np.float32)
    np.testing.assert_array_equal(wide[..., :8], np.asarray(apply_rotary(x, cos, sin), np.float32))
    np.testing.assert_array_equal(wide[..., 8:], np.broadcast_to([1.0, 0.0], (5, 2, 2)))
