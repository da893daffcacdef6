"""Several devices, on four CPU devices: data parallelism (a request's images spread over devices) and Ulysses
(every call's tokens split over a device group) give the embeddings the unbucketed single-device tower gives,
each on its own device; a warm multi-device encoder never compiles; bad splits are refused by name."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, pixels_for
from flax import nnx
from PIL import Image
from safetensors.numpy import load_file

import vitjax
from vitjax import layout, parallel
from vitjax.buckets import Bucket, BucketPolicy
from vitjax.cli import main as cli_main
from vitjax.encoder import abstract_tower
from vitjax.engine import Engine
from vitjax.parallel import pick_devices, split_balanced
from vitjax.preprocess import preprocess_image

CFG = TINY["hd72"]
POLICY = BucketPolicy(tokens=(64, 128, 256), segments=(1, 8), granule=64)
GRIDS = [(1, 8, 8), (2, 4, 6), (1, 2, 2), (1, 10, 12), (1, 6, 6), (1, 4, 14), (1, 16, 18)]  # last: own bucket


def test_four_cpu_devices_are_there():
    assert len(jax.local_devices()) == 4  # conftest's XLA flag: the tests below really spread over devices


def test_split_balanced():
    assert split_balanced([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert split_balanced([100, 1, 1], 2) == [range(0, 1), range(1, 3)]
    assert split_balanced([5], 3) == [range(0, 1), range(1, 1), range(1, 1)]  # a lone image goes to the first
    assert split_balanced([], 2) == [range(0, 0), range(0, 0)]
    sizes = [48, 96, 4, 120, 36, 56, 288, 64, 64, 200]
    for parts in (1, 2, 3, 4):
        groups = split_balanced(sizes, parts)
        assert len(groups) == parts
        assert [i for g in groups for i in g] == list(range(len(sizes)))  # whole items, in order, once
        best = min(  # brute force over every way to cut the list into `parts` contiguous pieces
            max(sum(sizes[a:b]) for a, b in itertools.pairwise((0, *cuts, len(sizes))))
            for cuts in itertools.combinations_with_replacement(range(len(sizes) + 1), parts - 1)
        )
        assert max(sum(sizes[i] for i in g) for g in groups) == best, parts


def test_pick_devices():
    local = jax.local_devices()
    assert pick_devices(None) == local[:1]
    assert pick_devices(2) == local[:2]
    assert pick_devices("all") == local
    assert pick_devices([local[3], local[1]]) == [local[3], local[1]]
    assert pick_devices(np.int64(2)) == local[:2]  # any integer counts
    assert pick_devices(local[2]) == [local[2]]  # a device alone (one engine on this GPU)
    bad_ones = [(0, "asked for 0"), (5, "asked for 5"), ("some", "count, 'all'"), ([local[0]] * 2, "distinct")]
    bad_ones += [(True, "count, 'all', a device or a list of devices, not True"), (2.0, "not 2.0")]
    bad_ones.append(([0, 1], r"devices must be distinct JAX devices, at least one, got \[0, 1\]"))
    for bad, match in bad_ones:
        with pytest.raises(ValueError, match=match):
            pick_devices(bad)


def test_device_settings_are_refused_before_the_checkpoint_is_read(checkpoint, monkeypatch):
    """Devices, their sequence-parallel groups and the buckets' fit to them: refused by name before the weights are
    read (for a real tower, a gigabyte or more)."""
    reads = []
    monkeypatch.setattr(vitjax.weights, "load_orbax", lambda *a, **kw: reads.append(a))
    odd_buckets = BucketPolicy(tokens=(68,), segments=(1,), granule=4, fit_granule=0)
    bad_ones = [
        ({"devices": 3, "sequence_parallel": 2}, "sequence_parallel=2 does not divide the 3 devices"),
        ({"devices": 9}, "asked for 9 devices, but this process has 4"),
        ({"devices": 2, "sequence_parallel": 2, "buckets": odd_buckets}, r"must be multiples of 8 to split"),
        ({"sequence_parallel": True}, "sequence_parallel must be a positive integer, got True"),
        ({"buckets": "tight"}, "buckets must be a vitjax.buckets.BucketPolicy, got 'tight'"),
        ({"cache_bytes": "1GB"}, "cache_bytes must be a whole number of bytes, 0 or more"),
        ({"cache_bytes": -5}, "cache_bytes must be a whole number of bytes, 0 or more"),
        ({"cache_bytes": 1.5}, "cache_bytes must be a whole number of bytes, 0 or more"),
    ]
    for settings, match in bad_ones:
        with pytest.raises(ValueError, match=match):
            vitjax.Encoder.from_pretrained(checkpoint, dtype="float32", **settings)
    with pytest.raises(TypeError, match="unknown Encoder setting.s. devise; the settings are attention, model_id"):
        vitjax.Encoder.from_pretrained(checkpoint, dtype="float32", devise=2)
    # cuDNN's and fa4's kernels need CUDA GPUs: named for CPU devices, the path is refused up front
    with pytest.raises(ValueError, match="attention 'cudnn_padded' runs on CUDA GPUs only, not on cpu devices"):
        vitjax.Encoder.from_pretrained(checkpoint, dtype="bfloat16", attention="cudnn_padded")
    monkeypatch.setenv("VITJAX_ATTENTION", "cudnn_padded")
    with pytest.raises(ValueError, match=r"\$VITJAX_ATTENTION 'cudnn_padded' runs on CUDA GPUs only"):
        vitjax.Encoder.from_pretrained(checkpoint, dtype="bfloat16")
    assert reads == []


def _random_params(cfg):
    rng = np.random.default_rng(0)
    shapes = nnx.to_pure_dict(nnx.state(abstract_tower(cfg, jnp.float32)))
    return jax.tree_util.tree_map_with_path(
        lambda path, s: rng.standard_normal(s.shape, np.float32) * 0.1 + (path[-1].key == "scale"), shapes
    )


@pytest.fixture(scope="module")
def params():
    return _random_params(CFG)


def _reference(params, pixels, grids, cfg=CFG):
    """Each image alone through the exact-size path on the default device."""
    enc = vitjax.Encoder.from_params(cfg, params, dtype="float32", buckets=POLICY)
    outs, row = [], 0
    for g in grids:
        n = layout.grid_tokens(g)
        packed = layout.pack([g], side=cfg.grid_side, merge=cfg.spatial_merge_size)
        outs.append(np.asarray(enc.run_packed(pixels[row : row + n], packed)))
        row += n
    return outs


def _close(got, ref, rel=1e-5):
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert float(np.abs(got - ref).max()) <= rel * float(np.abs(ref).max())


@pytest.mark.parametrize("devices", [2, 4])
def test_data_parallel_equals_single_device(params, devices, monkeypatch):
    """Each engine computes its group of images, given only that group's pixel rows: on the host exactly those, on a
    device a view of at least a chunk's rows around them (engines read device rows a chunk at a time)."""
    monkeypatch.setattr(vitjax.engine, "MAX_CHUNK_ROWS", 64)  # a group shorter than a chunk, with four devices
    monkeypatch.setattr(parallel, "MAX_CHUNK_ROWS", 64)
    enc = vitjax.Encoder.from_params(CFG, params, dtype="float32", buckets=POLICY, devices=devices)
    given, encode, host_path = [], Engine.encode, []

    def spy(engine: Engine, pixels, grids, first_row, **kw):
        given.append((engine.devices[0].id, len(pixels), first_row))
        return encode(engine, pixels, grids, first_row, **kw)

    monkeypatch.setattr(Engine, "encode", spy)
    monkeypatch.setattr(np, "asarray", functools.partial(_noting_device_arrays, host_path, np.asarray))
    x = pixels_for(GRIDS, CFG, seed=5)
    ref = _reference(params, x, GRIDS)
    groups = split_balanced([layout.grid_tokens(g) for g in GRIDS], devices)
    # 616 tokens, the largest image 288: two devices take 328 + 288, four need only three (<= 288 each)
    rows = [sum(layout.grid_tokens(GRIDS[i]) for i in g) for g in groups]
    assert rows == {2: [328, 288], 4: [272, 56, 288, 0]}[devices]
    ids = [d.id for d in jax.local_devices()]
    for pixels, shares in [
        (x, [(ids[k], n, 0) for k, n in enumerate(rows) if n]),  # host pixels
        (jnp.asarray(x), [(ids[k], max(n, 64), 0) for k, n in enumerate(rows) if n]),  # on (another) device
    ]:
        given.clear()
        host_path.clear()
        outs = enc.encode_patches(pixels, np.array(GRIDS))
        assert sorted(given) == shares and not host_path
        for k, group in enumerate(groups):
            for i in group:
                assert outs[i].devices() == {jax.local_devices()[k]}, (i, k)
                _close(np.asarray(outs[i]), ref[i])


def test_an_engine_reads_its_rows_inside_a_wider_device_view(params, monkeypatch):
    """A short group at the end of device-resident pixels: its engine gets a chunk's rows ending there, its own rows
    starting 48 in, and computes what one device does. Pixels spread over the devices are gathered once."""
    monkeypatch.setattr(vitjax.engine, "MAX_CHUNK_ROWS", 64)
    monkeypatch.setattr(parallel, "MAX_CHUNK_ROWS", 64)
    grids = [(1, 10, 20)] * 3 + [(1, 4, 4)]  # 200, 200, 200, 16 rows: one image an engine
    enc = vitjax.Encoder.from_params(CFG, params, dtype="float32", buckets=POLICY, devices=4)
    given, encode = [], Engine.encode

    def spy(engine: Engine, pixels, grids, first_row, **kw):
        given.append((engine.devices[0].id, len(pixels), first_row))
        return encode(engine, pixels, grids, first_row, **kw)

    monkeypatch.setattr(Engine, "encode", spy)
    x = pixels_for(grids, CFG, seed=9)
    ref = _reference(params, x, grids)
    ids = [d.id for d in jax.local_devices()]
    outs = enc.encode_patches(jnp.asarray(x), np.array(grids))
    assert sorted(given) == [(ids[0], 200, 0), (ids[1], 200, 0), (ids[2], 200, 0), (ids[3], 64, 48)]
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("d",))
    spread = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    given.clear()
    for out, want in zip([*outs, *enc.encode_patches(spread, np.array(grids))], ref * 2, strict=True):
        _close(np.asarray(out), want)
    assert sorted(given) == [(ids[0], 200, 0), (ids[1], 200, 0), (ids[2], 200, 0), (ids[3], 16, 0)]  # host rows


def _noting_device_arrays(seen: list, asarray, a, *args, **kw):
    """`np.asarray` that notes each JAX array it is given (device rows taken to the host)."""
    if isinstance(a, jax.Array):
        seen.append(a.shape)
    return asarray(a, *args, **kw)


def test_warm_data_parallel_encoder_never_compiles(params):
    enc = vitjax.Encoder.from_params(CFG, params, dtype="float32", buckets=POLICY, devices="all")
    buckets = [Bucket(t, s) for t in POLICY.tokens for s in POLICY.segments] + [Bucket(320, 1)]
    enc.warmup(buckets)
    built = enc.parallel.compiles
    assert built == 4 * len(buckets)  # one executable per bucket and device
    rng = np.random.default_rng(1)
    for seed in range(6):
        grids = [GRIDS[i] for i in rng.choice(len(GRIDS), size=rng.integers(1, 8))]
        outs = enc.encode_patches(pixels_for(grids, CFG, seed=seed), np.array(grids))
        assert [o.shape for o in outs] == [(layout.grid_tokens(g) // 4, CFG.output_width) for g in grids]
    assert enc.parallel.compiles == built


# Four heads of 72, so the heads split over up to four devices.
CFG4 = vitjax.VisionConfig(
    depth=2, hidden_size=288, num_heads=4, intermediate_size=96, out_hidden_size=40, deepstack_visual_indexes=(0,)
)


@pytest.mark.parametrize("devices, seq", [(2, 2), (4, 4), (4, 2)])
def test_sequence_parallel_equals_single_device(devices, seq):
    """Ulysses: every call's tokens split over `seq` devices (heads for attention); with 4 devices in groups of
    2, the groups also split the images between them."""
    params = _random_params(CFG4)
    enc = vitjax.Encoder.from_params(
        CFG4, params, dtype="float32", buckets=POLICY, devices=devices, sequence_parallel=seq
    )
    assert [e.devices for e in enc.parallel.engines] == [
        jax.local_devices()[i : i + seq] for i in range(0, devices, seq)
    ]
    x = pixels_for(GRIDS, CFG4, seed=6)
    ref = _reference(params, x, GRIDS, CFG4)
    groups = split_balanced([layout.grid_tokens(g) for g in GRIDS], devices // seq)
    outs = enc.encode_patches(x, np.array(GRIDS))
    for k, group in enumerate(groups):
        for i in group:
            assert outs[i].devices() == {jax.local_devices()[k * seq]}, (i, k)  # gathered on the group's first
            _close(np.asarray(outs[i]), ref[i])
    one = enc.encode_patches(jnp.asarray(x[:64]), np.array(GRIDS[:1]))[0]  # device-resident pixels too
    _close(np.asarray(one), ref[0])


def test_sequence_parallel_with_a_wider_v(monkeypatch):
    """Ulysses with V widened as fa4's value-sums schedule wants it (its extra columns traded apart from q and k),
    against one device with V as HF has it."""
    params = _random_params(CFG4)
    x = pixels_for(GRIDS, CFG4, seed=6)
    ref = _reference(params, x, GRIDS, CFG4)
    monkeypatch.setattr("vitjax.model.value_columns", lambda impl, head_dim: (1.0,) + (0.0,) * 7)
    enc = vitjax.Encoder.from_params(CFG4, params, dtype="float32", buckets=POLICY, devices=2, sequence_parallel=2)
    for got, want in zip(enc.encode_patches(x, np.array(GRIDS)), ref, strict=True):
        _close(np.asarray(got), want)


def test_sequence_parallel_refuses_what_cannot_split(params):
    with pytest.raises(ValueError, match="sequence_parallel=3 does not divide the 4 devices"):
        vitjax.Encoder.from_params(CFG, params, dtype="float32", devices=4, sequence_parallel=3)
    with pytest.raises(ValueError, match="sequence_parallel=4 does not divide the tower's 2 heads"):
        vitjax.Encoder.from_params(CFG, params, dtype="float32", devices=4, sequence_parallel=4)
    with pytest.raises(ValueError, match=r"sequence_parallel must be a positive integer, got 2.0"):
        vitjax.Encoder.from_params(CFG, params, dtype="float32", devices=4, sequence_parallel=2.0)
    # Sizes a group cannot split are refused with the encoder, not by the call that first needs one (a request of
    # one image past the ladder used to fail whole, errors="return" or not). fit_granule 0: the default is fine.
    for policy in (BucketPolicy(tokens=(68,), fit_granule=0), BucketPolicy(tokens=(64,), granule=4, fit_granule=0)):
        with pytest.raises(ValueError, match=r"must be multiples of 8 to split in whole 2x2 merge groups over a "):
            vitjax.Encoder.from_params(CFG, params, dtype="float32", devices=2, sequence_parallel=2, buckets=policy)


def test_pixels_on_several_devices_and_warmup_dtypes(params):
    """A request's pixels may be a JAX array held by several devices (replicated or split); they are gathered
    onto the engine's device. A warm-up for integer pixels compiles the float32 program they run in."""
    enc = vitjax.Encoder.from_params(CFG, params, dtype="float32", buckets=POLICY)
    x = pixels_for(GRIDS, CFG, seed=8)
    ref = [np.asarray(o) for o in enc.encode_patches(x, np.array(GRIDS))]
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("d",))
    for spec in (jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec("d")):
        spread = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
        for got, want in zip(enc.encode_patches(spread, np.array(GRIDS)), ref, strict=True):
            _close(np.asarray(got), want)
    fresh = vitjax.Encoder.from_params(CFG, params, dtype="float32", buckets=POLICY)
    fresh.warmup([Bucket(64, 1)], pixel_dtype="uint8")
    built = fresh.parallel.compiles
    levels = np.random.default_rng(0).integers(0, 256, (64, CFG.patch_dim), dtype=np.uint8)
    fresh.encode_patches(levels, np.array([(1, 8, 8)]))
    assert fresh.parallel.compiles == built == 1


def test_levels_split_over_devices_as_rows_are(params):
    """A bf16 tower's `encode` sends uint8 levels: over data-parallel engines and over Ulysses pairs each image's
    features are what one device gives."""
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (32 * (i + 1), 64, 3), np.uint8) for i in range(3)]
    settings = {"min_pixels": 32 * 32, "max_pixels": 96 * 64}
    one = vitjax.Encoder.from_params(CFG, params, dtype="bfloat16", buckets=POLICY)
    want = [np.asarray(r.features, np.float32) for r in one.encode(images, **settings)]
    rows, grids = zip(*(preprocess_image(image, **settings) for image in images), strict=True)
    hf = one.encode_patches(np.concatenate(rows).astype(jnp.bfloat16), np.concatenate(grids))  # HF's rows, rounded
    for got, ref in zip(want, hf, strict=True):
        np.testing.assert_array_equal(got, np.asarray(ref, np.float32))
    for kw in ({"devices": 2}, {"devices": 4, "sequence_parallel": 2}):
        enc = vitjax.Encoder.from_params(CFG, params, dtype="bfloat16", buckets=POLICY, **kw)
        got = enc.encode(images, **settings)
        assert {key[1].name for e in enc.parallel.engines for key in e._executables} == {"uint8"}
        for res, ref in zip(got, want, strict=True):
            _close(np.asarray(res.features, np.float32), ref, rel=1e-2)  # bf16: another split, other roundings


def test_cli_devices(checkpoint, tmp_path, capsys):
    """`--devices all` spreads the three images of one call over three devices, `--sequence-parallel 2` over
    two pairs of devices; both write what one device writes."""
    for i, color in enumerate(("red", "green", "blue")):
        Image.new("RGB", (64 + 32 * i, 64), color).save(tmp_path / f"{i}.png")
    outs = {}
    for flags in (("--devices", "1"), ("--devices", "all"), ("--devices", "4", "--sequence-parallel", "2")):
        out = tmp_path / f"{len(outs)}.safetensors"
        argv = ["encode", str(tmp_path), "--model", str(checkpoint), "--dtype", "float32", *flags]
        assert cli_main([*argv, "-o", str(out)]) == 0
        outs[flags] = load_file(out)
    one, *others = outs.values()
    assert sorted(one) == [f"{i}.{k}" for i in range(3) for k in ("deepstack", "embeds")]
    for other in others:
        assert sorted(other) == sorted(one)
        for key, value in one.items():
            _close(other[key], value)
    argv = ["encode", str(tmp_path), "--random-init", "qwen3-vl-2b", "--devices", "0", "-o", "x.safetensors"]
    assert cli_main(argv) == 2  # usage
    assert "expected a positive count or 'all'" in capsys.readouterr().err


def test_weights_live_only_on_the_encoders_devices(params):
    """An encoder on the second device (an SGLang rank on GPU 1) keeps no copy of its weights on the first, when
    built and after new weights are set in place."""
    second = jax.local_devices()[1]
    enc = vitjax.Encoder.from_params(CFG, params, dtype="float32", devices=[second], buckets=POLICY)

    def placement() -> set:
        leaves = jax.tree.leaves(enc._state) + jax.tree.leaves(enc.parallel.engines[0]._state)
        return {d for leaf in leaves for d in leaf.devices()}

    x = pixels_for(GRIDS[:2], CFG, seed=3)
    before = [np.asarray(o) for o in enc.encode_patches(x, np.array(GRIDS[:2]))]
    assert placement() == {second}
    doubled = jax.tree.map(lambda a: a * 2, enc.params())
    enc.set_params(doubled)
    assert placement() == {second}
    enc.set_params(jax.tree.map(lambda a: a / 2, doubled))
    for got, ref in zip(enc.encode_patches(x, np.array(GRIDS[:2])), before, strict=True):
        np.testing.assert_array_equal(np.asarray(got), ref)
