"""GPU parity at full size: vitjax (bf16) against HF transformers on the 8B vision config, random weights.

Skipped without an NVIDIA GPU. The shared conftest pins JAX to the CPU unless told otherwise, so run:

    JAX_PLATFORMS=cuda python -m pytest -m gpu tests/test_gpu_parity.py -s

Per image: cosine similarity and mean abs error of vitjax bf16 against HF fp32, beside HF's own bf16
against its fp32 (the gap bf16 itself costs); and the attention paths against each other (fa4 where fa4-jax
is installed on Hopper), both on raw attention (head_dim 72 and 64) and through the whole tower; with two GPUs,
the data-parallel encoder (its images split over both) and the Ulysses one (every call's tokens split over both) too.
"""

from __future__ import annotations

import copy
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitjax import attention, fa4, layout, weights

torch = pytest.importorskip("torch")


def _gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("JAX_PLATFORMS", "") != "cpu" and jax.default_backend() == "gpu"


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda)")]

# 720p, a portrait photo, a small square and a 2-frame video: 3520 + 768 + 256 + 480 patches.
GRIDS = [(1, 44, 80), (1, 32, 24), (1, 16, 16), (2, 12, 20)]
# Attention against the fp32 reference: max error per segment, as a share of the segment's output scale.
SCALED_TOLERANCE = 0.02


def _cos_mae(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), float(np.abs(a - b).mean())


def _error_to_scale(got: np.ndarray, ref: np.ndarray, segment_ids: np.ndarray) -> float:
    """The largest max |got - ref| / max |ref| over the packed segments: each segment's outputs are averages of its
    own V rows, so each has its own scale (a tiny frame's reach ~2, a 3,520-token frame's ~0.2, where an absolute
    bound would let a key dropped per segment pass). bf16 rounding alone is ~0.004 of the scale."""
    return max(
        float(np.abs(got[segment_ids == i] - ref[segment_ids == i]).max() / np.abs(ref[segment_ids == i]).max())
        for i in np.unique(segment_ids[segment_ids >= 0])
    )


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    """HF bf16 and fp32 towers with identical random weights, and vitjax encoders for each attention path."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    import vitjax

    cfg = vitjax.VisionConfig.preset("qwen3-vl-8b")
    hf_cfg = Qwen3VLVisionConfig(**{k: v for k, v in cfg.to_hf().items() if k != "model_type"})
    torch.manual_seed(0)
    with torch.device("cuda:0"):  # named: JAX calls on the second GPU leave it the CUDA runtime's current one
        hf = Qwen3VLVisionModel._from_config(hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        with torch.no_grad():  # HF leaves norms at 1 and biases at 0: perturb them so they are exercised
            for name, p in hf.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp("hf-8b")
    hf.save_pretrained(path)
    hf32 = copy.deepcopy(hf).float()
    params = weights.load_hf(path, cfg)
    encoders = {
        impl: vitjax.Encoder.from_params(cfg, params, dtype="bfloat16", attention=impl)
        for impl in attention.IMPLEMENTATIONS
        if _runs(impl)
    }
    if len(jax.devices()) >= 2:  # data parallel: the 720p frame on one GPU, the three others on the second
        encoders["2 GPUs"] = vitjax.Encoder.from_params(cfg, params, dtype="bfloat16", devices=2)
        # Ulysses: every call's tokens split over both GPUs, 8 heads each in attention
        ulysses = {"devices": 2, "sequence_parallel": 2}
        encoders["Ulysses 2"] = vitjax.Encoder.from_params(cfg, params, dtype="bfloat16", **ulysses)
    return cfg, hf, hf32, encoders


def _runs(impl: str) -> bool:
    """Whether this attention path can run here (cudnn_padded and the XLA reference run on any GPU)."""
    if impl == "cudnn_packed":
        return attention.cudnn_packed_available()
    return attention.fa4_available() if impl == "fa4" else True


def _hf(model, pixels: np.ndarray, dtype, grids=GRIDS) -> np.ndarray:
    with torch.inference_mode():
        out = model(torch.from_numpy(pixels).to("cuda:0", dtype), grid_thw=torch.tensor(grids, device="cuda:0"))
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1).float().cpu().numpy()


def test_tower_matches_hf(towers):
    cfg, hf, hf32, encoders = towers
    tokens = sum(layout.grid_tokens(g) for g in GRIDS)
    pixels = np.random.default_rng(0).standard_normal((tokens, cfg.patch_dim), dtype=np.float32)
    ref, hf_bf16 = _hf(hf32, pixels, torch.float32), _hf(hf, pixels, torch.bfloat16)
    outs = {impl: enc.encode_patches(pixels, np.array(GRIDS)) for impl, enc in encoders.items()}
    for i, (start, rows) in enumerate(layout.split_points(GRIDS)):
        hf_cos, hf_mae = _cos_mae(hf_bf16[start : start + rows], ref[start : start + rows])
        for impl, per_image in outs.items():
            got = np.asarray(per_image[i], np.float32)
            cos, mae = _cos_mae(got, ref[start : start + rows])
            print(
                f"image {i} {GRIDS[i]} {impl:>13}: cos {cos:.6f} mae {mae:.3e} | HF bf16 vs fp32: cos {hf_cos:.6f} "
                f"mae {hf_mae:.3e}"
            )
            assert cos > 0.995 and mae <= 1.5 * hf_mae, (impl, i, cos, mae, hf_cos, hf_mae)
    names = list(outs)
    for impl in names[1:]:
        for a, b in zip(outs[names[0]], outs[impl], strict=True):
            cos, _ = _cos_mae(np.asarray(a, np.float32), np.asarray(b, np.float32))
            assert cos > 0.999, (names[0], impl, cos)


def test_photos_match_hf(towers, tmp_path):
    """Photographs from their files, as `encode` takes them (vitjax's PIL preprocessing, the rows sent as uint8 levels
    and mapped on the device), against HF's image processor and its fp32 tower: real images, where the other tests
    feed noise. Two requests: the shipped photographs at their own sizes in one call, and one of them at 1920x1080
    alone, a bucket where fa4 takes its fixed shift."""
    from conftest import PHOTOS, make_hf
    from PIL import Image

    from vitjax.buckets import BucketPolicy

    cfg, hf, hf32, encoders = towers
    large = tmp_path / "photo-1080p.png"
    Image.open(PHOTOS[0]).convert("RGB").resize((1920, 1080), Image.Resampling.BICUBIC).save(large)
    for request in (PHOTOS, [large]):
        inputs = make_hf()(images=[Image.open(p) for p in request], return_tensors="np")
        grids = [tuple(map(int, g)) for g in inputs["image_grid_thw"]]
        pixels = inputs["pixel_values"]
        ref, hf_bf16 = _hf(hf32, pixels, torch.float32, grids), _hf(hf, pixels, torch.bfloat16, grids)
        outs = {impl: enc.encode([str(p) for p in request], decoder="pil") for impl, enc in encoders.items()}
        for impl, per_input in outs.items():
            for (start, rows), grid, out in zip(layout.split_points(grids), grids, per_input, strict=True):
                assert out.grid_thw == grid, (impl, out.name, out.grid_thw, grid)
                _, hf_mae = _cos_mae(hf_bf16[start : start + rows], ref[start : start + rows])
                cos, mae = _cos_mae(np.asarray(out.features, np.float32), ref[start : start + rows])
                print(f"{out.name} {grid} {impl:>13}: cos {cos:.6f} mae {mae:.3e} | HF bf16 vs fp32 mae {hf_mae:.3e}")
                assert cos > 0.995 and mae <= 1.5 * hf_mae, (impl, out.name, cos, mae, hf_mae)
            for a, b in zip(per_input, outs[next(iter(outs))], strict=True):
                cos, _ = _cos_mae(np.asarray(a.features, np.float32), np.asarray(b.features, np.float32))
                assert cos > 0.999, (impl, a.name, cos)
    if "fa4" in encoders and (tile := fa4.FA4_TILES.get(72)) is not None and tile.fixed_shift:
        [(bucket, _)] = BucketPolicy().plan(grids)  # the 1080p photo's call
        assert fa4.fa4_call_tile(72, bucket.tokens, bucket.segments).fixed_shift, bucket


def test_float32_and_float16_towers_match_hf(towers, monkeypatch):
    """The towers in the other dtypes SGLang serves in: float16 takes the automatic flash path, float32 XLA's (the
    flash kernels take 16-bit inputs; a float32 encoder once failed in fa4 on its first compile). Measured on an
    H100: MAE 0.12x (float16) and 0.016x (float32) of HF bf16's; the bounds are meant to fail float16 run as bf16
    (~1x) or float32 matmuls in TF32 (float16's mantissa)."""
    import vitjax

    monkeypatch.delenv(attention.ENV_VAR, raising=False)  # the automatic choice is what is tested
    cfg, hf, hf32, encoders = towers
    params = jax.tree.map(np.asarray, encoders[next(iter(encoders))].params())
    tokens = sum(layout.grid_tokens(g) for g in GRIDS)
    pixels = np.random.default_rng(3).standard_normal((tokens, cfg.patch_dim), dtype=np.float32)
    ref, hf_bf16 = _hf(hf32, pixels, torch.float32), _hf(hf, pixels, torch.bfloat16)
    for dtype, impl, most in (("float16", attention.default_implementation(), 0.3), ("float32", "reference", 0.05)):
        enc = vitjax.Encoder.from_params(cfg, params, dtype=dtype, cache_bytes=0)
        assert enc.attention == impl, (dtype, enc.attention)
        outs = enc.encode_patches(pixels, np.array(GRIDS))
        for i, (start, rows) in enumerate(layout.split_points(GRIDS)):
            _, hf_mae = _cos_mae(hf_bf16[start : start + rows], ref[start : start + rows])
            cos, mae = _cos_mae(np.asarray(outs[i], np.float32), ref[start : start + rows])
            print(f"image {i} {GRIDS[i]} {dtype} ({impl}): cos {cos:.6f} mae {mae:.3e} | HF bf16 mae {hf_mae:.3e}")
            assert cos > 0.9999 and mae <= most * hf_mae, (dtype, i, cos, mae, hf_mae)


def test_fixed_shift_tower_matches_hf(towers, monkeypatch):
    """The tower with fa4's fixed shift in every bucket (the test's 5,024 tokens would take the online maximum), on
    one GPU and, with two, under Ulysses: against HF fp32 as close as with the online maximum
    (`fa4.fa4_call_tile`)."""
    import vitjax

    cfg, hf, hf32, encoders = towers
    tile = fa4.FA4_TILES.get(72)
    if "fa4" not in encoders or tile is None or not tile.fixed_shift:
        pytest.skip("fa4's fixed-shift schedule runs on Hopper with fa4-jax")
    tokens = sum(layout.grid_tokens(g) for g in GRIDS)
    pixels = np.random.default_rng(4).standard_normal((tokens, cfg.patch_dim), dtype=np.float32)
    ref = _hf(hf32, pixels, torch.float32)
    online = encoders["fa4"].encode_patches(pixels, np.array(GRIDS))  # compiled under the shipped threshold
    monkeypatch.setattr(fa4, "FA4_FIXED_SHIFT_MIN_WORK", 0)
    params = jax.tree.map(np.asarray, encoders["fa4"].params())
    layouts = {"1 GPU": {}} | ({"Ulysses 2": {"devices": 2, "sequence_parallel": 2}} if len(jax.devices()) >= 2 else {})
    for name, kw in layouts.items():
        fixed = vitjax.Encoder.from_params(cfg, params, dtype="bfloat16", attention="fa4", cache_bytes=0, **kw)
        outs = fixed.encode_patches(pixels, np.array(GRIDS))
        for i, (start, rows) in enumerate(layout.split_points(GRIDS)):
            cos, mae = _cos_mae(np.asarray(outs[i], np.float32), ref[start : start + rows])
            _, online_mae = _cos_mae(np.asarray(online[i], np.float32), ref[start : start + rows])
            print(
                f"image {i} {GRIDS[i]} fa4 fixed shift, {name}: cos {cos:.6f} mae {mae:.3e} | online {online_mae:.3e}"
            )
            assert cos > 0.9999 and mae <= 1.01 * online_mae, (name, i, cos, mae, online_mae)


def test_fitted_bucket_matches_hf(towers):
    """A repeated request moves to its fitted bucket (4 x 720p: 14,336 tokens instead of the ladder's 16,384) and
    keeps the ladder bucket's accuracy against HF fp32."""
    cfg, hf, hf32, encoders = towers
    enc = encoders[attention.default_implementation()]
    engine = enc.parallel.engines[0]
    grids = [(1, 44, 80)] * 4
    pixels = np.random.default_rng(2).standard_normal((4 * 3520, cfg.patch_dim), dtype=np.float32)
    ref, hf_bf16 = _hf(hf32, pixels, torch.float32, grids), _hf(hf, pixels, torch.bfloat16, grids)
    ladder = enc.encode_patches(pixels, np.array(grids))
    enc.encode_patches(pixels, np.array(grids))  # the second call of the size starts the fitted compile
    engine.settle()
    fitted = enc.encode_patches(pixels, np.array(grids))
    assert [call.bucket.tokens for call in engine.run(pixels, grids)] == [14336]
    for i, (start, rows) in enumerate(layout.split_points(grids)):
        _, hf_mae = _cos_mae(hf_bf16[start : start + rows], ref[start : start + rows])
        for name, outs in (("ladder", ladder), ("fitted", fitted)):
            cos, mae = _cos_mae(np.asarray(outs[i], np.float32), ref[start : start + rows])
            print(f"4 x 720p, image {i}, {name} bucket: cos {cos:.6f} mae {mae:.3e} | HF bf16 mae {hf_mae:.3e}")
            assert cos > 0.995 and mae <= 1.5 * hf_mae, (name, i, cos, mae, hf_mae)


def test_a_caller_may_rewrite_its_pixel_array_once_encode_patches_returns(towers):
    """Rows the caller writes into its array once `encode_patches` returns are not the ones encoded: a GPU's
    `device_put` has read a host array by the time it returns (JAX 0.11.2 on an H100; the CPU engine copies its rows
    for this, tests/test_encode.py). One 4096 x 4096 photo (65,536 rows, 403 MB of float32); its last rows, which a
    copy still under way would reach last, are rewritten first."""
    cfg, _, _, encoders = towers
    enc = encoders[attention.default_implementation()]
    grid = np.array([(1, 256, 256)])
    rows = np.random.default_rng(4).standard_normal((65536, cfg.patch_dim), dtype=np.float32)
    want = np.asarray(enc.encode_patches(rows.copy(), grid)[0], np.float32)
    for _ in range(3):
        reused = rows.copy()
        out = enc.encode_patches(reused, grid)
        reused[-4096:] = 0
        got = np.asarray(out[0], np.float32)
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), np.abs(got - want).max()


def test_two_gpus_hold_their_images(towers):
    encoders = towers[3]
    if "2 GPUs" not in encoders:
        pytest.skip("needs two GPUs")
    tokens = sum(layout.grid_tokens(g) for g in GRIDS)
    pixels = np.random.default_rng(1).standard_normal((tokens, towers[0].patch_dim), dtype=np.float32)
    outs = encoders["2 GPUs"].encode_patches(pixels, np.array(GRIDS))
    assert [o.devices() for o in outs] == [{jax.devices()[0]}] + [{jax.devices()[1]}] * 3
    one = encoders[attention.default_implementation()].encode_patches(pixels, np.array(GRIDS))
    for a, b in zip(outs, one, strict=True):
        assert _cos_mae(np.asarray(a, np.float32), np.asarray(b, np.float32))[0] > 0.9999


@pytest.mark.parametrize("head_dim", [72, 64])
@pytest.mark.parametrize("grids, slots", [([(1, 38, 54), (2, 20, 26), (1, 2, 2), (1, 46, 30)], 8), ([(1, 44, 80)], 1)])
def test_attention_paths_agree(head_dim, grids, slots):
    """Odd frame sizes, a 2x2 frame, unused segment slots and tail padding; and one frame in a one-slot bucket."""
    packed = layout.pack(grids, 6144, slots)
    seg = attention.Segments(*(jnp.asarray(a) for a in packed[3:]), max_length=4096)
    rng = np.random.default_rng(head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal((6144, 16, head_dim)), jnp.bfloat16) for _ in range(3))
    run = jax.jit(attention.attention, static_argnums=4)
    ref = np.asarray(run(q, k, v, seg, "reference"), np.float32)
    real = packed.segment_ids >= 0
    for impl in [i for i in attention.IMPLEMENTATIONS if i != "reference" and _runs(i)]:
        got = np.asarray(run(q, k, v, seg, impl), np.float32)
        err, rel = float(np.abs(got[real] - ref[real]).max()), _error_to_scale(got, ref, packed.segment_ids)
        print(f"attention head_dim {head_dim} slots {slots} {impl}: max abs error {err:.4f} against fp32 reference, "
              f"{rel:.4f} of its segment's scale")  # fmt: skip
        assert rel < SCALED_TOLERANCE, (impl, err, rel)


@pytest.mark.parametrize("grids, slots", [([(1, 38, 54), (2, 20, 26), (1, 2, 2), (1, 46, 30)], 8), ([(1, 44, 80)], 1)])
def test_fa4_value_sums_agree(grids, slots):
    """fa4 with V widened by `value_columns` (each row's softmax sum from P·V's column 72, `vitjax.fa4_sums`) against
    the fp32 reference, its output at head_dim 72 all the same (`fa4._output_width`); its log-sum-exp (fa4's
    `return_lse`, which differentiation would use) against the narrow kernel's."""
    columns = attention.value_columns("fa4", 72)
    if not (_runs("fa4") and columns):
        pytest.skip("fa4 with value sums runs on Hopper with fa4-jax")
    from fa4_jax import flash_attn_varlen

    packed = layout.pack(grids, 6144, slots)
    seg = attention.Segments(*(jnp.asarray(a) for a in packed[3:]), max_length=4096)
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((6144, 16, 72)), jnp.bfloat16) for _ in range(3))
    wide = attention.widen(v, columns)
    real = packed.segment_ids >= 0
    ref = np.asarray(attention.attention(q, k, v, seg, "reference"), np.float32)
    got = np.asarray(jax.jit(attention.attention, static_argnums=4)(q, k, wide, seg, "fa4"), np.float32)
    assert got.shape[-1] == 72
    err, rel = float(np.abs(got[real] - ref[real]).max()), _error_to_scale(got, ref, packed.segment_ids)
    print(f"fa4 value sums, slots {slots}: max abs error {err:.4f} against fp32 reference, {rel:.4f} of the scale")
    assert rel < SCALED_TOLERANCE
    cu, used = fa4.cu_seqlens(seg, 6144), seg.lengths
    lse = [
        np.asarray(flash_attn_varlen(q, k, x, cu, cu, seqused_q=used, seqused_k=used, return_lse=True)[1])
        for x in (v, wide)
    ]
    np.testing.assert_allclose(lse[1][:, real], lse[0][:, real], atol=2e-3)


def test_fa4_calls_lowered_on_several_threads_keep_their_widths():
    """Buckets compile on several threads at once (a warm-up, the fitter). fa4's output width is set for the call a
    thread lowers (`fa4._narrowed`): at head_dim 72 with V widened each output is 72 wide, at 64 (no spare
    column) 64, and each is the fp32 reference's."""
    if not _runs("fa4"):
        pytest.skip("fa4 runs on Hopper with fa4-jax")
    import concurrent.futures

    def one(head_dim: int, rows: int) -> tuple[int, float]:
        tokens = 32 * rows
        packed = layout.pack([(1, 32, rows)], tokens, 1)
        seg = attention.Segments(*(jnp.asarray(a) for a in packed[3:]), max_length=tokens)
        rng = np.random.default_rng(tokens + head_dim)
        q, k, v = (jnp.asarray(rng.standard_normal((tokens, 16, head_dim)), jnp.bfloat16) for _ in range(3))
        wide = attention.widen(v, attention.value_columns("fa4", head_dim))
        got = jax.jit(attention.attention, static_argnums=4)(q, k, wide, seg, "fa4")
        ref = np.asarray(attention.attention(q, k, v, seg, "reference"), np.float32)
        return got.shape[-1], _error_to_scale(np.asarray(got, np.float32), ref, packed.segment_ids)

    cases = [(head_dim, rows) for rows in (32, 48, 64) for head_dim in (72, 64)]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: one(*case), cases))
    for (head_dim, rows), (width, err) in zip(cases, results, strict=True):
        print(f"fa4 lowered on a thread, head_dim {head_dim}, {32 * rows} tokens: width {width}, error {err:.4f} of "
              "the scale")  # fmt: skip
        assert width == head_dim and err < SCALED_TOLERANCE


@pytest.mark.parametrize("widened", [False, True])
@pytest.mark.parametrize("gap", [45.0, 100.0])
def test_fa4_fixed_shift_holds_or_falls_back(gap, widened, monkeypatch):
    """Under a `fixed_shift` schedule each row's exponentials are shifted by the maximum of the first block fa4 visits
    (the sequence's last keys). A key earlier in the sequence that outscores that block by `gap` (log2 units): at 45 the
    kernel holds (P up to 2^45 in fp32); at 100 it poisons those rows (NaN log-sum-exp) and `attention()` runs the call
    again with fa4's online maximum. Either way the result is the fp32 reference's. `widened`: q and k as the tower
    gives them under a `shift_column` schedule (`query_key_columns`), the shift written into q's column 72."""
    tile = fa4.FA4_TILES.get(72)
    if not (_runs("fa4") and tile is not None and tile.fixed_shift and (tile.shift_column or not widened)):
        pytest.skip("fa4's fixed-shift schedule runs on Hopper with fa4-jax")
    from fa4_jax import flash_attn_varlen

    monkeypatch.setattr(fa4, "FA4_FIXED_SHIFT_MIN_WORK", 0)  # this small call takes the fixed shift too
    grids = [(1, 60, 80), (1, 16, 16)]  # 4800 tokens (its first visited block: keys 4704..4799), then 256
    packed = layout.pack(grids, 6144, 4)
    seg = attention.Segments(*(jnp.asarray(a) for a in packed[3:]), max_length=4800)
    rng = np.random.default_rng(5)
    q, k, v = (0.5 * rng.standard_normal((6144, 16, 72)) for _ in range(3))
    q[:4800, :, 0] = 8.0
    k[7, :, 0] = gap / np.log2(np.e) * 72**0.5 / 8.0  # key 7's score past the first visited block's maximum (~1)
    scale, q_extra, k_extra = attention.query_key_columns("fa4", 72) if widened else (1.0, (), ())
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q * scale, k, v))  # one rounding of q, as in the tower
    ref_q = q.astype(jnp.float32) / scale  # the query the kernel sees, for the reference
    q, k = attention.widen(q, q_extra), attention.widen(k, k_extra)
    wide = attention.widen(v, attention.value_columns("fa4", 72))
    real = packed.segment_ids >= 0
    cu, used = fa4.cu_seqlens(seg, 6144), seg.lengths
    kw = {"scale": fa4.LN2, "mask_mod": fa4._mark(tile, 72)} if widened else {}
    lse = np.asarray(flash_attn_varlen(q, k, wide, cu, cu, seqused_q=used, seqused_k=used, return_lse=True, **kw)[1])
    poisoned = np.isnan(lse[:, real]).any(axis=0)
    assert (poisoned[:4800] == (gap > 64)).all() and not poisoned[4800:].any()
    ref = np.asarray(attention.attention(ref_q, k[..., :72], v, seg, "reference"), np.float32)
    got = np.asarray(jax.jit(attention.attention, static_argnums=(4, 5))(q, k, wide, seg, "fa4", 72), np.float32)
    assert got.shape[-1] == 72
    err, rel = float(np.abs(got[real] - ref[real]).max()), _error_to_scale(got, ref, packed.segment_ids)
    print(f"fa4 fixed shift, key past the first block by 2^{gap:.0f}, widened {widened}: max abs error {err:.4f}, "
          f"{rel:.4f} of the scale")  # fmt: skip
    assert rel < SCALED_TOLERANCE
