"""The attention paths off the GPU: the padded batch's gather/scatter, the automatic choice of path, fa4's
schedules and segment boundaries (the kernels themselves run in tests/test_gpu_parity.py)."""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY

import vitjax
from vitjax import attention, fa4, layout


@pytest.mark.parametrize("head_dim", [64, 72])
def test_padded_batch_matches_reference(head_dim):
    """The gather/scatter around the public API (run here with XLA): unused slots, padding, unequal frames."""
    grids = [(1, 4, 6), (2, 2, 4), (1, 6, 6)]
    packed = layout.pack(grids, 128, 8)
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.standard_normal((128, 2, head_dim), np.float32)) for _ in range(3))
    seg = attention.Segments(*(jnp.asarray(a) for a in packed[3:]), max_length=36)
    ref = attention.attention(q, k, v, seg, "reference")
    got = attention.padded_batch(q, k, v, seg, "xla")
    real = packed.segment_ids >= 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(ref)[real], atol=1e-5)
    assert np.all(np.asarray(got)[~real] == 0)


def test_reference_keeps_a_non_finite_value_in_its_own_segment():
    """A NaN or inf in one frame's v stays in that frame, as in HF's per-frame attention and the kernels: a
    masked-out key's probability is 0, but 0 x NaN in P.V is NaN for every query of the call."""
    grids = [(1, 4, 6), (2, 2, 4), (1, 6, 6)]
    packed = layout.pack(grids, 128, 8)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((128, 2, 72), np.float32) for _ in range(3))
    seg = attention.Segments(*(jnp.asarray(a) for a in packed[3:]), max_length=36)
    clean = np.asarray(attention.attention(*map(jnp.asarray, (q, k, v)), seg, "reference"))
    v[3, 1, 5], v[30, 0, 0] = np.nan, np.inf  # frame 0 head 1; frame 2 (the first of the second image) head 0
    got = np.asarray(attention.attention(*map(jnp.asarray, (q, k, v)), seg, "reference"))
    frame = packed.segment_ids
    expected = np.zeros(got.shape, bool)
    expected[frame == frame[3], 1, 5] = expected[frame == frame[30], 0, 0] = True
    assert np.array_equal(~np.isfinite(got), expected)
    np.testing.assert_array_equal(got[~expected], clean[~expected])
    padded = np.asarray(attention.padded_batch(*map(jnp.asarray, (q, k, v)), seg, "xla"))
    real = frame >= 0
    assert np.array_equal(~np.isfinite(padded[real]), expected[real])


@pytest.mark.parametrize("block, chunk", [(16, 8), (8, 24), (128, 128)])
def test_reference_scores_each_block_against_its_own_frames(block, chunk):
    """XLA's path runs a block of queries at a time against the chunks of keys its frames span, the softmax carried
    over chunks: the attention of each frame alone (jax.nn's over the padded batch), wherever frames start and end
    against blocks and chunks; a NaN in v stays in its frame; padding rows are zeros."""
    grids = [(1, 2, 4), (1, 4, 6), (2, 2, 4), (1, 6, 6), (1, 2, 2)]  # frames of 8, 24, 8, 8, 36, 4 tokens
    packed = layout.pack(grids, 128, 8)
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((128, 2, 72), np.float32) for _ in range(3))
    v[42, 1, 3] = np.nan  # the fourth frame (tokens 40-47), head 1
    seg = _segments(packed)
    got = np.asarray(attention._reference(*map(jnp.asarray, (q, k, v)), seg, block, chunk))
    want = np.asarray(attention.padded_batch(*map(jnp.asarray, (q, k, v)), seg, "xla"))
    frame, real = packed.segment_ids, packed.segment_ids >= 0
    poisoned = np.zeros(got.shape, bool)
    poisoned[frame == frame[42], 1, 3] = True
    assert np.array_equal(~np.isfinite(got), poisoned)
    np.testing.assert_allclose(got[real & ~poisoned.any((1, 2))], want[real & ~poisoned.any((1, 2))], atol=2e-6)
    assert np.all(got[~real] == 0)


def test_default_implementation(monkeypatch):
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    assert attention.default_implementation() == "reference"  # CPU
    monkeypatch.setenv(attention.ENV_VAR, "cudnn_padded")
    assert attention.default_implementation() == "cudnn_padded"
    monkeypatch.setenv(attention.ENV_VAR, "flash")
    with pytest.raises(ValueError, match="unknown attention implementation"):
        attention.default_implementation()
    assert attention.cudnn_packed_available() is False


def test_float32_towers_run_xlas_path(monkeypatch):
    """fa4's and cuDNN's kernels take 16-bit inputs only (fa4 raised "FA4 kernels take fp16/bf16 only" from inside a
    float32 Encoder's first compile on an H200): the automatic choice gives a float32 tower XLA's path, and a flash
    path named for one is refused up front, naming the setting."""
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    attention._auto.cache_clear()
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention, "_capabilities", lambda: ["9.0"])
    monkeypatch.setattr(fa4, "fa4_version", lambda: fa4.FA4_VERIFIED[0])
    try:
        assert [attention.default_implementation(d) for d in (None, "bfloat16", "float16")] == ["fa4"] * 3
        assert attention.default_implementation("float32") == attention.default_implementation(np.float32)
        assert attention.default_implementation("float32") == "reference"
        assert attention.check_implementation("reference", "float32") == "reference"
        for impl in ("fa4", "cudnn_packed", "cudnn_padded"):
            with pytest.raises(ValueError, match=f"attention '{impl}' takes bfloat16 or float16 towers, not float32"):
                attention.check_implementation(impl, "float32")
        monkeypatch.setenv(attention.ENV_VAR, "fa4")
        with pytest.raises(ValueError, match=r"\$VITJAX_ATTENTION 'fa4' takes bfloat16 or float16 towers"):
            attention.default_implementation("float32")
    finally:
        attention._auto.cache_clear()


def test_an_encoder_names_the_dtype_a_flash_path_refuses(tmp_path):
    """Before any weight is read, drawn or copied: a checkpoint path that does not exist is not even looked at."""
    refused = "attention 'cudnn_packed' takes bfloat16 or float16 towers, not float32"
    with pytest.raises(ValueError, match=refused):
        vitjax.Encoder.random(TINY["hd64"], dtype="float32", attention="cudnn_packed")
    with pytest.raises(ValueError, match=refused):
        vitjax.Encoder.from_pretrained(tmp_path / "nothing here", dtype="float32", attention="cudnn_packed")
    with pytest.raises(ValueError, match=refused):
        vitjax.Encoder.from_params(TINY["hd64"], {}, dtype="float32", attention="cudnn_packed")
    assert vitjax.Encoder.random(TINY["hd64"], dtype="float32", attention="reference").attention == "reference"


def test_select_implementation():
    """The automatic choice: fa4 only on all-Hopper devices with a verified fa4-jax; cuDNN packed on Hopper or newer
    with a usable entry point; the padded cuDNN path on other GPUs; XLA off the GPU."""
    release = fa4.FA4_VERIFIED[0]
    select = attention.select_implementation
    assert select("cpu", [], release, True) == "reference"
    assert select("gpu", ["9.0"], release, True) == "fa4"
    assert select("gpu", ["9.0", "9.0"], release, False) == "fa4"
    assert select("gpu", ["9.0"], None, True) == "cudnn_packed"  # not installed: cuDNN is the fallback
    assert select("gpu", ["9.0"], "0.0.1", True) == "cudnn_packed"  # a release nobody checked
    assert select("gpu", ["10.0"], release, True) == "cudnn_packed"  # Blackwell: fa4 not measured there
    assert select("gpu", ["9.0", "8.0"], release, True) == "cudnn_padded"  # one Ampere device rules both out
    assert select("gpu", ["8.6"], release, True) == "cudnn_padded"
    assert select("gpu", ["9.0"], None, False) == "cudnn_padded"


def test_bucket_implementation(monkeypatch):
    """The automatic fa4 choice runs buckets past FA4_MAX_SEGMENTS slots (a video's slices) through cuDNN's packed
    path where its entry point is usable; a path the caller named runs in every bucket."""
    pick = attention.bucket_implementation
    monkeypatch.setattr(attention, "_packed_entry", lambda: (None, None))
    assert [pick("fa4", s, True) for s in (1, 64, 65, 384)] == ["fa4", "fa4", "cudnn_packed", "cudnn_packed"]
    assert pick("fa4", 384, False) == "fa4"
    assert [pick(impl, 384, True) for impl in ("cudnn_padded", "reference")] == ["cudnn_padded", "reference"]
    monkeypatch.setattr(attention, "_packed_entry", lambda: None)
    assert pick("fa4", 384, True) == "fa4"


def test_fa4_needs_its_package():
    if fa4.fa4_version() is not None:
        pytest.skip("fa4-jax is installed here")
    assert attention.fa4_available() is False
    with pytest.raises(ValueError, match="fa4-jax"):
        attention.check_implementation("fa4")


@pytest.mark.parametrize(
    "text, tile",
    [
        ("192x144ss", fa4.Fa4Tile(192, 144, False, 2)),
        ("128x176rs", fa4.Fa4Tile(128, 176, True, 2)),
        ("128x176rs3", fa4.Fa4Tile(128, 176, True, 3)),
        ("192x112rs3", fa4.Fa4Tile(192, 112, True, 3)),
        ("192x112rs3:vsum", fa4.Fa4Tile(192, 112, True, 3, value_sums=True)),
        ("192x112rs3:vsum:fix", fa4.Fa4Tile(192, 112, True, 3, value_sums=True, fixed_shift=True)),
        ("192x112rs3:vsum:fix:col", fa4.Fa4Tile(192, 112, True, 3, True, True, shift_column=True)),
    ],
)
def test_fa4_tile_names(text, tile):
    assert fa4.Fa4Tile.parse(text) == tile and str(tile) == text


@pytest.mark.parametrize(
    "text",
    ["192x144", "192*144ss", "x144ss", "192x144rr", "192x144ss3x", "192x112rs3:sum", "192x112rs3:fix", "192x112:col"],
)
def test_fa4_tile_bad_names(text):
    with pytest.raises(ValueError, match=f"fa4 tile '{re.escape(text)}'"):
        fa4.Fa4Tile.parse(text)


@pytest.mark.parametrize("flags", [{"fixed_shift": True}, {"value_sums": True, "shift_column": True}])
def test_fa4_tile_flags_that_need_another(flags):
    """The fixed shift reads its overflow from the value sums, and the shift column writes the fixed shift."""
    with pytest.raises(ValueError, match="the fixed shift needs the value sums, and the shift column the fixed shift"):
        fa4.Fa4Tile(192, 112, True, 3, **flags)


def test_value_columns(monkeypatch):
    """fa4 under a value_sums schedule takes V at its tile's width, a ones column first, where the tile pads the head
    dim (72 in 80, the 8B-and-larger towers); no other path or head dim widens V."""
    assert attention.value_columns("fa4", 72) == (1.0,) + (0.0,) * 7  # the shipped schedule
    assert attention.value_columns("cudnn_packed", 72) == attention.value_columns("reference", 72) == ()
    tiles = {72: fa4.Fa4Tile(192, 112, True, 3), 64: fa4.Fa4Tile(192, 112, True, 3, value_sums=True)}
    monkeypatch.setattr(fa4, "FA4_TILES", {**tiles, 40: tiles[64]})
    assert attention.value_columns("fa4", 72) == ()  # a schedule without value sums
    assert attention.value_columns("fa4", 64) == ()  # 64 fills its tile: no spare column
    assert attention.value_columns("fa4", 40) == (1.0,) + (0.0,) * 7  # 40 runs as 48
    assert attention.value_columns("fa4", 96) == ()  # no schedule of ours: fa4-jax's own


def test_query_key_columns(monkeypatch):
    """Under a shift-column schedule (the shipped one at head_dim 72) fa4 takes q scaled to log2 units and widened by
    zeros, k widened by a one and zeros, where V takes its sum column; elsewhere q and k go as they are."""
    scale = 72**-0.5 * np.log2(np.e)
    assert attention.query_key_columns("fa4", 72) == (pytest.approx(scale, rel=1e-12), (0.0,) * 8, (1.0,) + (0.0,) * 7)
    assert attention.query_key_columns("cudnn_packed", 72) == attention.query_key_columns("fa4", 64) == (1.0, (), ())
    assert attention.query_key_columns("fa4", 72, "float16") == (1.0, (), ())  # float16 keeps the online maximum
    monkeypatch.setitem(fa4.FA4_TILES, 72, fa4.Fa4Tile(192, 112, True, 3, True, True))
    assert attention.query_key_columns("fa4", 72) == (1.0, (), ())  # the fixed shift without the column


def test_widened_query_keys_only_for_fa4():
    """The portable paths refuse q and k said to be widened (only fa4's kernel knows the shift column)."""
    packed = layout.pack([(1, 4, 4)], 16, 1)
    x = jnp.zeros((16, 2, 80), jnp.float32)
    with pytest.raises(ValueError, match="at head_dim 72, not widened to 80"):
        attention.attention(x, x, x, _segments(packed), "reference", head_dim=72)


def test_fa4_call_tile(monkeypatch):
    """The fixed shift (and its column) where a bucket's attention work repays its overflow check: the 20-photo and
    8 x 1080p buckets, one or two 1080p images (8,192 tokens in one slot, 16,384 in four), not one or two 720p images
    (3,584 in one, 8,192 in four) nor a bucket of clip frames; the rest of the schedule unchanged; head dims without a
    schedule of ours keep fa4-jax's."""
    fixed = fa4.Fa4Tile(192, 112, True, 3, value_sums=True, fixed_shift=True, shift_column=True)
    monkeypatch.setattr(fa4, "FA4_TILES", {72: fixed})
    for tokens, slots in [(98304, 64), (65536, 16), (16384, 1), (8192, 1), (16384, 4)]:
        assert fa4.fa4_call_tile(72, tokens, slots) == fixed
    online = dataclasses.replace(fixed, fixed_shift=False, shift_column=False)
    for tokens, slots in [(3584, 1), (32768, 64), (8192, 4)]:
        assert fa4.fa4_call_tile(72, tokens, slots) == online
    assert fa4.fa4_call_tile(64, 98304, 64) is None
    assert fa4.fa4_call_tile(72, 98304, 64, "float16") == online  # P in float16 stops at 2^16


def _seq_split(fn, devices: int):
    """`fn(q, k, v)` with the tokens split over `devices` CPU devices (Ulysses), outputs gathered back."""
    import jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("seq",))
    split = jax.sharding.PartitionSpec("seq")
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(split,) * 3, out_specs=split))


def test_a_wider_v_gives_the_same_attention():
    """V with `value_columns` appended (as the tower makes it for fa4): the output is the attention at head_dim, as
    with V as it is (the appended columns are fa4's alone), on one device and with the tokens split over two (Ulysses,
    where the wider V is traded apart from q and k)."""
    grids = [(1, 4, 6), (2, 2, 4), (1, 6, 6)]
    packed = layout.pack(grids, 128, 8)
    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(rng.standard_normal((128, 4, 72), np.float32)) for _ in range(3))
    columns = (1.0,) + (0.0,) * 7
    wide = attention.widen(v, columns)
    real = packed.segment_ids >= 0
    narrow = np.asarray(attention.attention(q, k, v, _segments(packed), "reference"))[real]
    whole = np.asarray(attention.attention(q, k, wide, _segments(packed), "reference"))[real]
    split = _seq_split(lambda q, k, v: attention.attention(q, k, v, _segments(packed, "seq"), "reference"), 2)
    for got in (whole, np.asarray(split(q, k, wide))[real]):
        assert got.shape == (real.sum(), 4, 72)
        np.testing.assert_allclose(got, narrow, rtol=1e-5, atol=1e-5)


def _segments(packed, seq_axis=None) -> attention.Segments:
    return attention.Segments(*(jnp.asarray(a) for a in packed[3:]), max_length=36, seq_axis=seq_axis)


def test_set_fa4_tile_without_the_package(monkeypatch):
    """Choosing a schedule only records it (fa4-jax is imported at the first fa4 trace); None restores fa4-jax's."""
    monkeypatch.setattr(fa4, "FA4_TILES", dict(fa4.FA4_TILES))
    tile = fa4.Fa4Tile(128, 176, True)
    fa4.set_fa4_tile(64, tile)
    assert fa4.FA4_TILES[64] == tile
    fa4.set_fa4_tile(64, None)
    assert 64 not in fa4.FA4_TILES


@pytest.mark.parametrize(
    "grids, expected",
    [
        ([(1, 4, 6), (2, 2, 4), (1, 6, 6)], [0, 24, 32, 40, 128, 128, 128, 128, 128]),
        ([(1, 4, 6)] * 8, [0, 24, 48, 72, 96, 120, 144, 168, 192]),  # every slot used, no tail padding
        ([], [0] + [128] * 8),  # nothing to attend: every slot empty
    ],
)
def test_cu_seqlens(grids, expected):
    """fa4's segment boundaries: slot b covers [cu[b], cu[b+1]) and attends over its first lengths[b] tokens, which
    must be exactly the tokens of frame b (the tail padding sits in the last frame's slot, past its length)."""
    tokens = max(128, sum(layout.grid_tokens(g) for g in grids))
    packed = layout.pack(grids, tokens, 8)
    seg = attention.Segments(*(jnp.asarray(a) for a in packed[3:]))
    cu = np.asarray(fa4.cu_seqlens(seg, tokens))
    assert cu.dtype == np.int32 and cu.tolist() == expected
    covered = np.full(tokens, -1)
    for b, length in enumerate(packed.segment_lengths):
        assert cu[b] + length <= cu[b + 1]
        covered[cu[b] : cu[b] + length] = b
    np.testing.assert_array_equal(covered, packed.segment_ids)
