"""Images in, embeddings out: Encoder.encode, the per-image cache, and `vitjax encode` end to end."""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import tqdm
import tqdm.auto
from conftest import MAX_PIXELS, PHOTOS, TINY, make_hf
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import load_file

import vitjax
from vitjax import layout
from vitjax.cache import EmbeddingCache
from vitjax.cli import main as cli_main
from vitjax.images import ImageInputError
from vitjax.pipeline import Item, Pipeline, default_workers
from vitjax.preprocess import MIN_PIXELS
from vitjax.weights import CheckpointError


@pytest.fixture()
def enc(checkpoint):
    return vitjax.Encoder.from_pretrained(checkpoint, dtype="float32")


def test_a_callers_progress_bar_advances_once_an_input(enc, capsys):
    """One bar over several calls (the CLI's chunks): any tqdm bar, tqdm.auto's or the plain one, and no bar of the
    encoder's own beside it."""
    for make in (tqdm.tqdm, tqdm.auto.tqdm):
        text = io.StringIO()
        with make(total=3, file=text) as bar:
            enc.encode([PHOTOS[0], PHOTOS[1], PHOTOS[0]], max_pixels=MAX_PIXELS, progress=bar)
            assert bar.n == 3
        assert "3/3" in text.getvalue() and capsys.readouterr().err == ""


def hf_pixels(path: Path, max_pixels: int = MAX_PIXELS, backend: str = "pil"):
    out = make_hf(max_pixels=max_pixels, backend=backend)(images=[Image.open(path)], return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def test_encode_equals_encode_patches_on_hf_pixels(enc):
    results = enc.encode([str(p) for p in PHOTOS[:3]], max_pixels=MAX_PIXELS)
    width = enc.cfg.out_hidden_size
    for path, res in zip(PHOTOS[:3], results, strict=True):
        pixels, grid = hf_pixels(path)
        ref = np.asarray(enc.encode_patches(pixels, grid)[0])
        assert res.grid_thw == tuple(grid[0]) and res.name == str(path)
        np.testing.assert_allclose(np.asarray(res.embeds), ref[:, :width], rtol=1e-5, atol=1e-5)
        deep = np.asarray(res.deepstack)
        assert deep.shape == (2, ref.shape[0], width)
        for k in range(2):
            np.testing.assert_allclose(deep[k], ref[:, width * (k + 1) : width * (k + 2)], rtol=1e-5, atol=1e-5)


def test_the_torchvision_backend_encodes_hf_torchvision_rows_and_is_cached_apart(enc):
    """Embeddings of the rows `AutoProcessor`'s default image processor gives on the CPU; an image encoded with both
    backends is two cache entries."""
    paths = [str(p) for p in PHOTOS[:2]]
    pil = enc.encode(paths, max_pixels=MAX_PIXELS)
    torchvision = enc.encode(paths, max_pixels=MAX_PIXELS, image_processor_backend="torchvision")
    assert enc.images_encoded == 4
    for path, res, other in zip(PHOTOS[:2], torchvision, pil, strict=True):
        pixels, grid = hf_pixels(path, backend="torchvision")
        ref = np.asarray(enc.encode_patches(pixels, grid)[0])
        assert res.grid_thw == other.grid_thw == tuple(grid[0])
        np.testing.assert_allclose(np.asarray(res.features), ref, rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(res.embeds) - np.asarray(other.embeds)).max() > 1e-3  # other rows, other output
    again = enc.encode(paths[::-1], max_pixels=MAX_PIXELS, image_processor_backend="torchvision")
    assert enc.images_encoded == 4
    for hit, res in zip(again, torchvision[::-1], strict=True):  # from the cache: the torchvision rows' outputs
        np.testing.assert_array_equal(np.asarray(hit.features), np.asarray(res.features))


def test_a_caller_may_rewrite_its_pixel_array_once_encode_patches_returns(enc):
    """The tower must not read the caller's array after `encode_patches` returns: JAX's CPU arrays alias a host array
    where it is 64-byte aligned, so the engine copies its rows there. Here the array is aligned, as an allocator may
    well give it (tests/test_gpu_parity.py holds a GPU to the same)."""
    grid = np.array([[1, 64, 64]])
    rows = np.random.default_rng(3).standard_normal((4096, enc.cfg.patch_dim)).astype(np.float32)
    want = [np.asarray(out) for out in enc.encode_patches(rows.copy(), grid)]
    memory = np.empty(rows.size + 16, np.float32)
    skip = (-memory.ctypes.data % 64) // 4
    reused = memory[skip : skip + rows.size].reshape(rows.shape)
    for _ in range(3):
        reused[:] = rows
        outs = enc.encode_patches(reused, grid)
        reused[:] = 0
        for got, expected in zip(outs, want, strict=True):
            np.testing.assert_array_equal(np.asarray(got), expected)


def test_bfloat16_encode_equals_encode_patches_on_hf_pixels(checkpoint):
    """A bf16 tower gets bf16 pixel rows from `encode` (half the bytes): HF's fp32 rows rounded once, as a
    bf16 tower rounds them anyway, and close to what the fp32 rows give (another executable, other fusions)."""
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="bfloat16")
    (res,) = enc.encode([str(PHOTOS[1])], max_pixels=MAX_PIXELS)
    pixels, grid = hf_pixels(PHOTOS[1])
    got = np.asarray(res.features)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, np.asarray(enc.encode_patches(pixels.astype(ml_dtypes.bfloat16), grid)[0]))
    ref = np.asarray(enc.encode_patches(pixels, grid)[0], np.float32)
    cos = (got.astype(np.float32) * ref).sum() / np.linalg.norm(got.astype(np.float32)) / np.linalg.norm(ref)
    assert cos > 0.999, cos


def test_duplicates_are_encoded_once_and_hits_are_identical(enc):
    photo = PHOTOS[0]
    first = enc.encode([str(photo), photo.read_bytes(), Image.open(photo)], max_pixels=MAX_PIXELS)
    assert enc.images_encoded == 1
    assert enc.cache.stats.misses == 1
    assert first[0].features is first[1].features is first[2].features
    again = enc.encode([photo.read_bytes()], max_pixels=MAX_PIXELS)
    assert enc.images_encoded == 1 and enc.cache.stats.hits == 1
    # Bit for bit, from the cache's own copy (the first call's results view that call's whole output).
    np.testing.assert_array_equal(np.asarray(again[0].features), np.asarray(first[0].features))
    assert again[0].features.unsafe_buffer_pointer() != first[0].features.unsafe_buffer_pointer()
    # Other preprocessing settings are another key.
    enc.encode([str(photo)], min_pixels=MAX_PIXELS // 4, max_pixels=MAX_PIXELS // 4)
    assert enc.images_encoded == 2 and enc.cache.stats.misses == 2


def test_new_weights_empty_the_cache_and_keep_its_counters(checkpoint):
    """After `set_params` a cached image is encoded again with the new weights (an RL trainer's update must not be
    answered from the old weights' results), and the cache's counters go on from where they were."""
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32")
    (old,) = enc.encode([str(PHOTOS[0])], max_pixels=MAX_PIXELS)
    enc.encode([str(PHOTOS[0])], max_pixels=MAX_PIXELS)  # a hit
    scaled = jax.tree.map(lambda a: a * 1.5, enc.params())
    enc.set_params(scaled)
    (new,) = enc.encode([str(PHOTOS[0])], max_pixels=MAX_PIXELS)
    assert enc.images_encoded == 2
    (ref,) = vitjax.Encoder.from_params(enc.cfg, scaled, dtype="float32").encode(
        [str(PHOTOS[0])], max_pixels=MAX_PIXELS
    )
    np.testing.assert_array_equal(np.asarray(new.features), np.asarray(ref.features))
    assert np.abs(np.asarray(new.features) - np.asarray(old.features)).max() > 0.1
    stats = enc.cache.stats
    assert (stats.hits, stats.misses, stats.entries, stats.bytes) == (1, 2, 1, np.asarray(new.features).nbytes), stats


def test_cache_evicts_least_recently_used_by_bytes():
    cache = EmbeddingCache(max_bytes=3 * 400)
    arrays = {k: np.full(100, k, np.float32) for k in range(4)}  # 400 bytes each
    for k in range(3):
        cache.put(k, arrays[k])
    assert cache.get(0) is arrays[0]  # 0 is now the most recent
    cache.put(3, arrays[3])
    assert 1 not in cache and {0, 2, 3} <= {k for k in range(4) if k in cache}
    stats = cache.stats
    assert (stats.entries, stats.bytes, stats.evictions, stats.hits) == (3, 1200, 1, 1)
    cache.put(9, np.zeros(1000, np.float32))  # larger than the whole budget: not stored, nothing evicted
    assert 9 not in cache and cache.stats.entries == 3


def test_encoder_cache_is_bounded(checkpoint):
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32", cache_bytes=1)
    enc.encode([str(PHOTOS[0])], max_pixels=MAX_PIXELS)
    enc.encode([str(PHOTOS[0])], max_pixels=MAX_PIXELS)
    assert enc.images_encoded == 2 and len(enc.cache) == 0
    assert vitjax.Encoder.from_pretrained(checkpoint, cache_bytes=2e9).cache.max_bytes == 2_000_000_000  # a whole float


def test_cache_bound_covers_the_memory_it_keeps(checkpoint):
    """Per-image results are views of their call's whole output; a cached one must not keep that output alive."""
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32")
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}  # what other tests and fixtures keep is not this encoder's
    results = enc.encode([str(p) for p in PHOTOS[:4]], max_pixels=MAX_PIXELS)
    assert len(enc.cache) == 4
    del results
    gc.collect()
    new = [a for a in jax.live_arrays() if id(a) not in before]
    features = [a for a in new if a.ndim == 2 and a.shape[1] == enc.cfg.output_width]
    assert sum(a.nbytes for a in features) == enc.cache.stats.bytes, [a.shape for a in features]


def _bad_inputs(tmp: Path) -> dict[str, str]:
    """name -> a fragment its error message must contain."""
    (tmp / "empty.jpg").write_bytes(b"")
    (tmp / "truncated.jpg").write_bytes(
        (Path(__file__).parent / "data" / "images" / "astronaut.jpg").read_bytes()[:5000]
    )
    (tmp / "notes.jpg").write_text("this is not an image")
    Image.new("RGB", (600, 2), "red").save(tmp / "wide.png")
    Image.new("RGB", (1000, 600), "red").save(tmp / "bomb.png")  # over the limit the test sets below
    return {
        str(tmp / "empty.jpg"): "empty input",
        str(tmp / "truncated.jpg"): "truncated",
        str(tmp / "notes.jpg"): "not a recognised image format",
        str(tmp / "missing.png"): "no such file",
        str(tmp / "wide.png"): "aspect ratio 300",
        str(tmp / "bomb.png"): "decompression",
    }


def test_bad_inputs_do_not_cost_the_batch(enc, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 400_000)  # bomb.png is over it, under PIL's own 2x error
    bad = _bad_inputs(tmp_path)
    Image.new("RGB", (1, 1), "green").save(tmp_path / "dot.png")  # valid: HF upsamples it to 256x256
    good = [str(PHOTOS[0]), str(tmp_path / "dot.png")]
    inputs = [good[0], *bad, good[1]]
    results = enc.encode(inputs, max_pixels=MAX_PIXELS, errors="return")
    assert [type(r).__name__ for r in results] == ["Encoded", *["ImageInputError"] * len(bad), "Encoded"]
    for (name, fragment), err in zip(bad.items(), results[1:-1], strict=True):
        assert err.name == name and str(err).startswith(name) and fragment in str(err), str(err)
    assert results[-1].grid_thw == (1, 16, 16) and results[-1].embeds.shape == (64, enc.cfg.out_hidden_size)
    alone = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32", cache_bytes=0)
    for path, res in zip(good, (results[0], results[-1]), strict=True):
        (ref,) = alone.encode([path], max_pixels=MAX_PIXELS)
        np.testing.assert_allclose(np.asarray(res.features), np.asarray(ref.features), rtol=1e-5, atol=1e-5)
    with pytest.raises(ImageInputError, match="empty.jpg: empty input"):
        enc.encode(inputs, max_pixels=MAX_PIXELS)


def test_broken_link_in_a_folder_is_reported_by_name(enc, tmp_path):
    (tmp_path / "a.png").symlink_to(PHOTOS[0])
    (tmp_path / "b.jpg").symlink_to(tmp_path / "gone.jpg")
    good, broken = enc.encode([tmp_path], max_pixels=MAX_PIXELS, errors="return")
    assert good.name == str(tmp_path / "a.png") and good.grid_thw[0] == 1
    assert str(broken) == f"{tmp_path / 'b.jpg'}: broken symbolic link (to {tmp_path / 'gone.jpg'})"


def test_small_batches_stream_the_same_embeddings(enc, checkpoint, monkeypatch):
    """Calls of one image each (every image is larger than batch_tokens=1, so a call of its own) give what one call
    for all gives."""
    paths = [str(p) for p in PHOTOS[:4]]
    whole = enc.encode(paths, max_pixels=MAX_PIXELS)
    single = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32", cache_bytes=0)
    calls = []
    dispatch = single._dispatch
    monkeypatch.setattr(
        single, "_dispatch", lambda pipe, batch, *a: calls.append(batch.rows) or dispatch(pipe, batch, *a)
    )
    streamed = single.encode(paths, max_pixels=MAX_PIXELS, batch_tokens=1)
    assert single.images_encoded == 4 and calls == [layout.grid_tokens(s.grid_thw) for s in streamed]
    for a, b in zip(whole, streamed, strict=True):
        assert a.grid_thw == b.grid_thw and a.sha256 == b.sha256
        np.testing.assert_allclose(np.asarray(a.features), np.asarray(b.features), rtol=1e-5, atol=1e-5)


def test_the_next_call_is_prepared_while_a_dispatch_waits_for_the_device(enc, checkpoint, monkeypatch):
    """A call whose dispatch waits until the device is done (fa4's overflow check makes XLA's loop wait for its flag
    on the host) must not hold up the host's work on the next call: calls are dispatched from a thread of their own.
    Here the first call's dispatch waits until the second image has joined the next call's batch."""
    single = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32", cache_bytes=0)
    added, seen = threading.Event(), []
    real_add, real_encode = vitjax.pipeline.Batch.add, single.encode_patches

    def add(batch, item, *a):
        seen.append(item.name)
        if len(seen) == 2:
            added.set()
        return real_add(batch, item, *a)

    def encode_patches(pixels, grids, **kw):
        if not added.is_set():
            assert added.wait(30), "the next batch was not prepared while this call was dispatched"
        return real_encode(pixels, grids, **kw)

    monkeypatch.setattr(vitjax.pipeline.Batch, "add", add)
    monkeypatch.setattr(single, "encode_patches", encode_patches)
    paths = [str(p) for p in PHOTOS[:3]]
    streamed = single.encode(paths, max_pixels=MAX_PIXELS, batch_tokens=1)
    assert seen == paths and single.images_encoded == 3
    for a, b in zip(enc.encode(paths, max_pixels=MAX_PIXELS), streamed, strict=True):
        np.testing.assert_allclose(np.asarray(a.features), np.asarray(b.features), rtol=1e-5, atol=1e-5)


def test_a_failed_encode_leaves_a_key_it_settled_to_whoever_claimed_it_again():
    """A's first call puts X (the cache keeps nothing: cache_bytes=0), so B claims X anew and C waits on B; then A's
    second call fails. A gives up only the keys it never settled: C gets B's result, not A's error."""
    enc = vitjax.Encoder.random(TINY["hd64"], dtype="float32", cache_bytes=0)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, 255, (64, 64, 3), np.uint8) for _ in range(2))
    real, calls, results = enc.encode_patches, [], {}
    b_claimed, release = threading.Event(), threading.Event()

    def run(name, images, **kw):
        try:
            results[name] = enc.encode(images, min_pixels=64 * 64, **kw)
        except BaseException as e:  # A's failure is the point
            results[name] = e

    def encode_patches(pixels, grids, **kw):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:  # A's second call (y): B claims x again, C waits on B's claim; then this call fails
            threading.Thread(target=run, args=("B", [x]), name="B").start()
            assert b_claimed.wait(60)
            threading.Thread(target=run, args=("C", [x]), kwargs={"errors": "return"}, name="C").start()
            deadline = time.monotonic() + 60
            while enc.cache.stats.hits == 0:  # C found B's claim
                assert time.monotonic() < deadline
                time.sleep(0.01)
            raise RuntimeError("A's second call failed")
        if len(calls) == 3:  # B's call, held until A has failed
            b_claimed.set()
            assert release.wait(60)
        return real(pixels, grids, **kw)

    enc.encode_patches = encode_patches
    run("A", [x, y], batch_tokens=1)
    assert isinstance(results["A"], RuntimeError)
    release.set()
    deadline = time.monotonic() + 120
    while len(results) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [type(r).__name__ for r in results["B"]] == [type(r).__name__ for r in results["C"]] == ["Encoded"]
    np.testing.assert_array_equal(np.asarray(results["B"][0].features), np.asarray(results["C"][0].features))


def test_prepare_runs_a_bounded_window_ahead(enc):
    """However many inputs come, at most `window` are read ahead of what the consumer has taken."""
    data = PHOTOS[0].read_bytes()
    read = []

    def inputs():
        for i in range(20):
            read.append(i)
            yield f"<bytes #{i}>", data

    with Pipeline(enc.cfg, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, pixel_dtype=np.float32, window=3) as pipe:
        for taken, item in enumerate(pipe.prepare(inputs()), start=1):
            assert isinstance(item, Item) and len(read) - taken <= 3 - 1
    assert taken == 20


@pytest.mark.parametrize(("cores", "workers", "window"), [(64, 16, 32), (16, 16, 32), (2, 2, 4)])
def test_the_pipeline_takes_a_thread_a_core_up_to_16(enc, monkeypatch, cores, workers, window):
    """Without `workers`, one preprocessing thread a core the process may run on, at most 16 (16 beat 8 end to end on
    H200 hosts, and 32 did not beat 16); the read-ahead window is twice that."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 128)  # the host's: not what the process is given
    with Pipeline(enc.cfg, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, pixel_dtype=np.float32) as pipe:
        assert pipe._pool._max_workers == workers and pipe.window == window


@pytest.mark.parametrize(("cores", "workers"), [(64, 16), (3, 3), (None, 1)])
def test_without_an_affinity_the_pipeline_counts_the_hosts_cores(monkeypatch, cores, workers):
    monkeypatch.delattr("os.sched_getaffinity", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert default_workers() == workers


def test_encode_takes_the_threads_it_is_given(enc, monkeypatch):
    """`workers` sets the preprocessing threads of that request (and only its); the embeddings do not depend on them."""
    pools = []

    class Recorded(Pipeline):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self._pool._max_workers)

    monkeypatch.setattr(vitjax.encoder, "Pipeline", Recorded)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)), raising=False)
    inputs = [str(p) for p in PHOTOS]
    one = enc.encode(inputs, max_pixels=MAX_PIXELS, workers=1)
    enc.cache.clear()  # encoded again, not found
    default = enc.encode(inputs, max_pixels=MAX_PIXELS)
    assert pools == [1, 16] and enc.cache.stats.hits == 0
    for a, b in zip(one, default, strict=True):
        np.testing.assert_array_equal(np.asarray(a.features), np.asarray(b.features))


def test_an_image_another_thread_is_encoding_is_waited_for(enc):
    """In-flight deduplication: while one caller holds the claim on an image, another encode of it waits for
    that caller's result instead of computing it again."""
    path = str(PHOTOS[0])
    with Pipeline(enc.cfg, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, pixel_dtype=np.float32) as pipe:
        (item,) = pipe.prepare([(path, path)])
        key = (enc.model_id, *pipe.cache_key(item))
    assert enc.cache.claim(key) is None  # this thread is "encoding" it now
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(enc.encode, [path], max_pixels=MAX_PIXELS)
        deadline = time.monotonic() + 60
        while enc.cache.stats.hits == 0:  # the other encode found the claim (a miss would compute it)
            assert time.monotonic() < deadline and not waiting.done(), waiting.exception()
            time.sleep(0.01)
        pixels, grid = hf_pixels(PHOTOS[0])
        value = ((1, *grid[0, 1:].tolist()), enc.encode_patches(pixels, grid)[0])
        enc.cache.put(key, value)
        (res,) = waiting.result()
    assert res.features is value[1] and enc.images_encoded == 0
    # A claim given up with an input error hands the waiter that error, named as the waiter named its input.
    other = (enc.model_id, "pil", "other digest", MIN_PIXELS, MAX_PIXELS)
    assert enc.cache.claim(other) is None
    future = enc.cache.claim(other)
    enc.cache.abandon(other, ImageInputError("first.png", "corrupt"))
    with pytest.raises(ImageInputError, match="first.png: corrupt"):
        future.result()
    assert enc.cache.claim(other) is None  # abandoned: the next caller computes it


def test_an_interrupt_as_a_claim_is_taken_leaves_no_claim(enc, monkeypatch):
    """Ctrl-C landing as the cache hands an encode an image's claim, before the encode's own code runs again, still
    gives the claim up: a later caller computes the image instead of waiting on it forever."""
    path = str(PHOTOS[3])
    with Pipeline(enc.cfg, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, pixel_dtype=np.float32) as pipe:
        (item,) = pipe.prepare([(path, path)])
        key = (enc.model_id, *pipe.cache_key(item))
    claim = enc.cache.claim

    def interrupted(*args):
        if claim(*args) is None:
            raise KeyboardInterrupt
        raise AssertionError("the image was not claimed")

    monkeypatch.setattr(enc.cache, "claim", interrupted)
    with pytest.raises(KeyboardInterrupt):
        enc.encode([path], max_pixels=MAX_PIXELS)
    monkeypatch.undo()
    assert enc.cache.claim(key) is None  # not a Future of a claim nobody holds
    enc.cache.abandon(key, RuntimeError("test over"))


def test_a_failed_call_leaves_no_claim_and_costs_a_waiter_only_that_image(checkpoint, monkeypatch):
    """A call that fails after its tower ran (here: storing into the cache runs out of memory) gives up its claims,
    so a later encode of the image does not wait forever; and a caller waiting on an image whose call failed gets
    it as that input's error, its other inputs still encoded."""
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32")
    path, other, shared = str(PHOTOS[0]), str(PHOTOS[1]), str(PHOTOS[2])

    def out_of_memory(key, value):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory copying the features")

    monkeypatch.setattr(enc.cache, "put", out_of_memory)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        enc.encode([path], max_pixels=MAX_PIXELS)
    monkeypatch.undo()
    again: list = []
    thread = threading.Thread(target=lambda: again.extend(enc.encode([path], max_pixels=MAX_PIXELS)), daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive() and again[0].grid_thw == (1, 16, 16)
    with Pipeline(enc.cfg, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, pixel_dtype=np.float32) as pipe:
        (item,) = pipe.prepare([(shared, shared)])
        key = (enc.model_id, *pipe.cache_key(item))
    assert enc.cache.claim(key) is None  # another caller is "encoding" it
    hits = enc.cache.stats.hits
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(enc.encode, [other, shared], max_pixels=MAX_PIXELS, errors="return")
        deadline = time.monotonic() + 60
        while enc.cache.stats.hits == hits:  # the waiter found the claim
            assert time.monotonic() < deadline and not waiting.done(), waiting.exception()
            time.sleep(0.01)
        enc.cache.abandon(key, RuntimeError("the encode computing this image failed: out of memory"))
        good, failed = waiting.result()
    assert good.name == other and good.features.shape[0] > 0
    assert isinstance(failed, ImageInputError) and failed.name == shared and "out of memory" in failed.reason


def test_cli_encode_end_to_end(checkpoint, tmp_path, capsys):
    out = tmp_path / "out.safetensors"
    inputs = [str(p) for p in PHOTOS[:3]]
    bad = str(tmp_path / "missing.jpg")
    code = cli_main(
        [
            "encode",
            *inputs,
            bad,
            "--model",
            str(checkpoint),
            "--dtype",
            "float32",
            "--max-pixels",
            str(MAX_PIXELS),
            "-o",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and bad in err and "wrote 3 of 4 images" in err
    tensors = load_file(out)
    with safe_open(out, "np") as f:
        meta = json.loads(f.metadata()["vitjax"])
    assert meta["dtype"] == "float32" and meta["model"] == str(checkpoint.resolve()) and meta["vitjax_version"]
    assert meta["images"][3] == {"index": 3, "source": bad, "error": "no such file"}
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32")
    width = enc.cfg.out_hidden_size
    for i, path in enumerate(PHOTOS[:3]):
        pixels, grid = hf_pixels(path)
        ref = np.asarray(enc.encode_patches(pixels, grid)[0])
        assert meta["images"][i]["grid_thw"] == grid[0].tolist() and meta["images"][i]["source"] == str(path)
        np.testing.assert_allclose(tensors[f"{i}.embeds"], ref[:, :width], rtol=1e-5, atol=1e-5)
        deep = tensors[f"{i}.deepstack"]
        np.testing.assert_allclose(deep.transpose(1, 0, 2).reshape(len(ref), -1), ref[:, width:], rtol=1e-5, atol=1e-5)
    assert "3.embeds" not in tensors


def test_cli_image_processor_backend(checkpoint, tmp_path, capsys):
    out = tmp_path / "tv.safetensors"
    args = ["encode", str(PHOTOS[0]), "--model", str(checkpoint), "--dtype", "float32", "--max-pixels", str(MAX_PIXELS)]
    assert cli_main([*args, "--image-processor-backend", "torchvision", "-o", str(out), "--quiet"]) == 0
    with safe_open(out, "np") as f:
        meta = json.loads(f.metadata()["vitjax"])
    assert meta["image_processor_backend"] == "torchvision"
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32")
    pixels, grid = hf_pixels(PHOTOS[0], backend="torchvision")
    ref = np.asarray(enc.encode_patches(pixels, grid)[0])
    np.testing.assert_allclose(load_file(out)["0.embeds"], ref[:, : enc.cfg.out_hidden_size], rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    code = cli_main([*args, "--image-processor-backend", "fast", "-o", str(tmp_path / "x.safetensors")])
    assert code == 2 and "--image-processor-backend: invalid choice: 'fast'" in capsys.readouterr().err


def test_cli_float16_tower(checkpoint, tmp_path):
    """`--dtype float16`, a tower dtype the API has (as SGLang serves float16 checkpoints): float16 embeddings, those
    of the API's float16 tower."""
    out = tmp_path / "f16.safetensors"
    args = ["encode", str(PHOTOS[0]), "--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "--quiet"]
    assert cli_main([*args, "--dtype", "float16", "-o", str(out)]) == 0
    embeds = load_file(out)["0.embeds"]
    (ref,) = vitjax.Encoder.from_pretrained(checkpoint, dtype="float16").encode([PHOTOS[0]], max_pixels=MAX_PIXELS)
    assert embeds.dtype == np.float16
    np.testing.assert_array_equal(embeds, np.asarray(ref.embeds))


def test_cli_random_init_says_so(tmp_path, capsys):
    img = io.BytesIO()
    Image.new("RGB", (64, 64), "blue").save(img, "PNG")
    (tmp_path / "blue.png").write_bytes(img.getvalue())
    out = tmp_path / "r.safetensors"
    # The smallest real preset keeps this honest about what --random-init builds.
    code = cli_main(["encode", str(tmp_path), "--random-init", "qwen3-vl-2b", "--dtype", "float32", "-o", str(out)])
    assert code == 0 and "RANDOM weights" in capsys.readouterr().err
    tensors = load_file(out)
    assert tensors["0.embeds"].shape == (64, 2048) and tensors["0.deepstack"].shape == (3, 64, 2048)


def test_a_dtype_no_tower_runs_in_is_named_before_any_weight(tmp_path):
    """A misspelt or non-float dtype: a ValueError naming `dtype`, before a checkpoint is read or weights drawn."""
    for dtype in ("bfloat61", "int8", "float64", None):
        refused = rf"^dtype={dtype!r}: the tower runs in one of bfloat16, float16, float32$"
        with pytest.raises(ValueError, match=refused):
            vitjax.Encoder.from_pretrained(tmp_path / "nothing here", dtype=dtype)
        with pytest.raises(ValueError, match=refused):
            vitjax.Encoder.random(TINY["hd64"], dtype=dtype)
        with pytest.raises(ValueError, match=refused):
            vitjax.Encoder.from_params(TINY["hd64"], {}, dtype=dtype)
    assert vitjax.Encoder.random(TINY["hd64"], dtype=np.float16).dtype == np.float16


def test_from_params_holds_the_weights_to_the_config():
    """As loading and `set_params` do: weights of another config, or with a leaf missing, are refused up front
    (else `embeds` would take deepstack columns, or the first encode would fail deep in tracing)."""
    cfg = TINY["hd64"]
    params = vitjax.Encoder.random(cfg, dtype="float32").params()
    wider = dataclasses.replace(cfg, out_hidden_size=cfg.out_hidden_size + 8)
    with pytest.raises(CheckpointError, match=r"^from_params: parameter deepstack_merger_list/linear_fc2/bias has"):
        vitjax.Encoder.from_params(wider, params, dtype="float32")
    del params["blocks"]["attn"]["proj"]["bias"]
    with pytest.raises(CheckpointError, match=r"^from_params: 1 parameters missing: blocks/attn/proj/bias$"):
        vitjax.Encoder.from_params(cfg, params, dtype="float32")
