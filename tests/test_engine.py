"""The engine's bucketed calls: padding is invisible, requests split correctly, and a warm engine never compiles."""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, pixels_for
from flax import nnx
from test_buckets import POLICY

import vitjax
import vitjax.encoder
import vitjax.leftovers
import vitjax.preprocess
from vitjax import attention, layout
from vitjax.buckets import Bucket, BucketPolicy
from vitjax.encoder import abstract_tower
from vitjax.engine import enable_compilation_cache

CFG = TINY["hd72"]
# Requests that all fit the policy's buckets: single images, mixes, a video, a 2x2 image.
REQUESTS = [
    [(1, 4, 4)],
    [(1, 8, 8)],
    [(1, 6, 10), (1, 2, 2)],
    [(2, 4, 6), (1, 8, 4), (1, 4, 8)],
    [(1, 2, 2)] * 8,
    [(1, 10, 12), (1, 6, 6)],
    [(1, 4, 14)] * 4,
]


def _random_encoder(policy: BucketPolicy = POLICY, dtype: str = "float32", **kw):
    """Random weights drawn in numpy (initializing the Flax modules eagerly compiles dozens of ops)."""
    rng = np.random.default_rng(0)
    shapes = nnx.to_pure_dict(nnx.state(abstract_tower(CFG, jnp.float32)))
    params = jax.tree_util.tree_map_with_path(
        lambda path, s: rng.standard_normal(s.shape, np.float32) * 0.1 + (path[-1].key == "scale"), shapes
    )
    return vitjax.Encoder.from_params(CFG, params, dtype=dtype, buckets=policy, **kw)


@pytest.fixture(scope="module")
def enc():
    return _random_encoder()


def _unbucketed(enc, pixels, grids):
    """The whole request through the exact-size (unpadded) path in one call, split per image."""
    packed = layout.pack(grids, side=CFG.grid_side, merge=CFG.spatial_merge_size)
    out = np.asarray(enc.run_packed(pixels, packed))
    return [out[start : start + rows] for start, rows in layout.split_points(grids, CFG.merge_unit)]


def _close(got, ref, rel=1e-5):
    assert got.shape == ref.shape, (got.shape, ref.shape)
    scale = float(np.abs(ref).max())
    assert float(np.abs(got - ref).max()) <= rel * scale


FIT_POLICY = BucketPolicy(tokens=(64, 128, 256), segments=(1, 8), granule=64, fit_granule=32)


def _bucket_rows(engine, x, grids) -> list[int]:
    """The token count of each call's bucket, checked against its output (a row per 2x2 merge group)."""
    calls = engine.run(x, grids)
    assert [c.output.shape[0] * 4 for c in calls] == [c.bucket.tokens for c in calls]
    return [c.bucket.tokens for c in calls]


def test_repeated_sizes_move_to_a_fitted_bucket():
    """The second call of a size compiles its fitted bucket in the background while it runs in the ladder's; once
    compiled, calls of that size run there, with the same embeddings."""
    enc = _random_encoder(FIT_POLICY)
    engine = enc.parallel.engines[0]
    grids = [(1, 10, 12), (1, 8, 10)]  # 200 tokens: bucket 256, fitted 224
    x = pixels_for(grids, CFG, seed=5)
    ladder = enc.encode_patches(x, np.array(grids))
    assert _bucket_rows(engine, x, grids) == [256]
    built = engine.compiles
    engine.settle()
    assert _bucket_rows(engine, x, grids) == [224]
    assert engine.compiles == built + 1
    for got, ref, exact in zip(enc.encode_patches(x, np.array(grids)), ladder, _unbucketed(enc, x, grids), strict=True):
        _close(got, ref)
        _close(got, exact)
    other = [(1, 10, 18)]  # 180 tokens, fitted 192: counted apart
    y = pixels_for(other, CFG, seed=6)
    assert _bucket_rows(engine, y, other) == [256]
    engine.settle()
    assert _bucket_rows(engine, y, other) == [256]
    engine.settle()
    assert _bucket_rows(engine, y, other) == [192]
    assert _bucket_rows(engine, x, grids) == [224]


def test_calls_from_several_threads_take_up_a_compiled_fitted_bucket_once():
    """Two threads that both find the fitted compile done: one moves it into place, the other then finds it there
    (the engine's tables are shared; a lookup made slow here widens the window in which both look)."""
    enc = _random_encoder(FIT_POLICY)
    engine = enc.parallel.engines[0]
    grids = [(1, 10, 12), (1, 8, 10)]  # 200 tokens: fitted 224
    x = pixels_for(grids, CFG, seed=5)
    engine.run(x, grids)
    engine.run(x, grids)
    engine.settle()

    class SlowLookups(dict):
        def get(self, *args):
            found = super().get(*args)
            time.sleep(0.2)
            return found

    engine._fitting = SlowLookups(engine._fitting)
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(engine.run, x, grids) for _ in range(2)]
        buckets_used = sorted(c.result()[0].bucket.tokens for c in calls)
    assert buckets_used == [224, 224] and not engine._fitting


def test_a_warmed_up_bucket_serves_as_the_fitted_one():
    enc = _random_encoder(FIT_POLICY)
    enc.warmup([Bucket(224, 8)], run=False)
    grids = [(1, 10, 12), (1, 8, 10)]  # 200 tokens: fitted 224
    assert _bucket_rows(enc.parallel.engines[0], pixels_for(grids, CFG, seed=5), grids) == [224]
    assert enc.parallel.compiles == 1  # the ladder's 256 is never needed


def _two_sizes_through_one_fitted_slot(monkeypatch):
    """An engine that keeps one fitted executable, after two sizes took turns in it: 224's compiled, then dropped
    for 192's. Returns the encoder, the engine, and each size's grids and pixels."""
    monkeypatch.setattr(vitjax.engine, "FITTED_EXECUTABLES", 1)
    enc = _random_encoder(FIT_POLICY)
    engine = enc.parallel.engines[0]
    first, second = [(1, 10, 20)], [(1, 10, 18)]  # 200 and 180 tokens: fitted 224 and 192
    x, y = pixels_for(first, CFG, seed=7), pixels_for(second, CFG, seed=8)
    for _ in range(2):
        _bucket_rows(engine, x, first)
        _bucket_rows(engine, y, second)
    assert engine.settle()
    assert _bucket_rows(engine, x, first) == [224]
    assert _bucket_rows(engine, y, second) == [192]  # the second fitted executable drops the first
    assert [key[0] for key in engine._fitted] == [Bucket(192, 1)]
    return enc, engine, (first, x), (second, y)


def test_fitted_buckets_are_bounded_and_failures_stay_on_the_ladder(monkeypatch, caplog):
    enc, engine, (first, x), _ = _two_sizes_through_one_fitted_slot(monkeypatch)
    assert _bucket_rows(engine, x, first) == [256]

    compile_, tries, entered, release = engine._compile, [], threading.Event(), threading.Event()

    def failing(bucket, *args):
        if bucket == Bucket(160, 1):
            tries.append((bucket, sys.getswitchinterval()))
            entered.set()
            release.wait(60)
            raise RuntimeError("out of memory while autotuning")
        return compile_(bucket, *args)

    monkeypatch.setattr(engine, "_compile", failing)
    third = [(1, 10, 16)]  # 160 tokens, fitted 160
    z = pixels_for(third, CFG, seed=9)
    expected = enc.encode_patches(z, np.array(third))[0]
    interval = sys.getswitchinterval()
    assert interval > vitjax.engine.FIT_SWITCH_INTERVAL  # Python's default, 5 ms
    assert _bucket_rows(engine, z, third) == [256]
    assert not engine.settle(timeout=0.2)  # the compile is still running; calls stay on the ladder meanwhile
    assert _bucket_rows(engine, z, third) == [256]
    assert entered.wait(60)
    # the serving thread gets the lock back soon (Python keeps the interval in whole microseconds)
    assert sys.getswitchinterval() == pytest.approx(vitjax.engine.FIT_SWITCH_INTERVAL)
    release.set()
    assert engine.settle()
    assert sys.getswitchinterval() == interval  # restored, though the compile failed
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "vitjax.engine"):
        warnings.simplefilter("error")  # `-W error`: the failure is logged, and the call that finds it still runs
        assert _bucket_rows(engine, z, third) == [256]
    assert [r.getMessage() for r in caplog.records] == [
        "vitjax: no fitted bucket Bucket(tokens=160, segments=1) (out of memory while autotuning); its calls stay in "
        "their ladder bucket"
    ]
    for _ in range(3):
        _close(enc.encode_patches(z, np.array(third))[0], expected)
    engine.settle()
    assert tries == [(Bucket(160, 1), pytest.approx(vitjax.engine.FIT_SWITCH_INTERVAL))]  # tried once, never again


def test_fitted_compiles_of_sizes_that_do_not_come_back_are_held_to_the_bound(monkeypatch):
    """A size seen twice and then never again: its finished compile is installed (and dropped past the bound) when the
    next compile is submitted, not kept beside the bound for the life of the process."""
    monkeypatch.setattr(vitjax.engine, "FITTED_EXECUTABLES", 2)
    enc = _random_encoder(FIT_POLICY)
    engine = enc.parallel.engines[0]
    sizes = [[(1, 8, w)] for w in (10, 18, 22, 26)]  # 80, 144, 176, 208 tokens: fitted 96, 160, 192, 224
    for grids in sizes:
        x = pixels_for(grids, CFG, seed=3)
        for _ in range(2):
            _bucket_rows(engine, x, grids)
        assert engine.settle()
    assert [key[0].tokens for key in engine._fitted] == [160, 192]  # 96 dropped past the bound of 2
    assert [key[0].tokens for key in engine._fitting] == [224]  # finished; installed by the next call or submission
    assert sum(key in engine._executables for key in engine._fitted) == 2
    assert engine.compiles == 2 + 3  # the ladder buckets of 128 and 256, and three fitted ones installed


def test_a_dropped_fitted_size_needs_twice_the_calls_to_compile_again(monkeypatch):
    """Sizes rotating through more fitted buckets than the table holds: each time a size's executable is dropped,
    the calls it needs before compiling again double, so the fitting thread is not kept compiling."""
    _, engine, (first, x), _ = _two_sizes_through_one_fitted_slot(monkeypatch)  # 224 dropped once
    for _ in range(3):
        assert _bucket_rows(engine, x, first) == [256] and not engine._fitting
    assert _bucket_rows(engine, x, first) == [256]  # the fourth call since the drop
    assert [key[0] for key in engine._fitting] == [Bucket(224, 1)]
    assert engine.settle()
    assert _bucket_rows(engine, x, first) == [224]  # drops 192
    assert {key[0]: n for key, n in engine._drops.items()} == {Bucket(224, 1): 1, Bucket(192, 1): 1}


def test_a_warm_up_naming_a_bucket_fitting_in_the_background_takes_up_that_compile(monkeypatch):
    enc = _random_encoder(FIT_POLICY)
    engine = enc.parallel.engines[0]
    grids = [(1, 10, 12), (1, 8, 10)]  # 200 tokens: fitted 224
    x = pixels_for(grids, CFG, seed=5)
    compile_, tries, release = engine._compile, [], threading.Event()

    def held(bucket, *args):
        tries.append(bucket)
        if bucket == Bucket(224, 8):
            release.wait(60)
        return compile_(bucket, *args)

    monkeypatch.setattr(engine, "_compile", held)
    for _ in range(2):
        assert _bucket_rows(engine, x, grids) == [256]
    with ThreadPoolExecutor(1) as pool:
        warm = pool.submit(enc.warmup, [Bucket(224, 8)], run=False)
        assert not engine.settle(timeout=0.2)  # the fitted compile is held; the warm-up waits for it
        release.set()
        warm.result()
    assert tries == [Bucket(256, 8), Bucket(224, 8)] and not engine._fitting
    assert not engine._fitted  # named by the warm-up: kept outside the fitted bound
    assert _bucket_rows(engine, x, grids) == [224]


def test_a_warm_up_compiles_a_bucket_itself_where_its_background_compile_failed(monkeypatch):
    enc = _random_encoder(FIT_POLICY)
    engine = enc.parallel.engines[0]
    grids = [(1, 10, 12), (1, 8, 10)]  # 200 tokens: fitted 224
    x = pixels_for(grids, CFG, seed=5)
    compile_, tries = engine._compile, []

    def failing_once(bucket, *args):
        tries.append(bucket)
        if tries.count(bucket) == 1 and bucket == Bucket(224, 8):
            raise RuntimeError("out of memory while autotuning")
        return compile_(bucket, *args)

    monkeypatch.setattr(engine, "_compile", failing_once)
    for _ in range(2):
        engine.run(x, grids)
    assert engine.settle()
    enc.warmup([Bucket(224, 8)], run=False)  # the background compile's error is not the warm-up's
    assert tries == [Bucket(256, 8), Bucket(224, 8), Bucket(224, 8)] and not engine._fitting
    assert _bucket_rows(engine, x, grids) == [224]


def test_a_fitted_compile_finishing_after_a_warm_up_compiled_its_bucket_leaves_the_warm_ups():
    """A call can submit a fitted compile between a warm-up's two looks at the tables, so both compile the bucket.
    The warm-up's executable stays when the other finishes, outside the fitted bound (it is never dropped)."""
    enc = _random_encoder(FIT_POLICY)
    engine = enc.parallel.engines[0]
    enc.warmup([Bucket(224, 8)], run=False)
    ((key, warmed),) = engine._executables.items()
    late = Future()
    late.set_result(object())
    engine._fitting[key] = late
    with engine._fit_lock:
        assert engine._install(key)
    assert engine._executables[key] is warmed and not engine._fitted and not engine._fitting


def test_fitted_compiles_cancelled_or_refused_at_exit_leave_the_calls_served(monkeypatch, caplog):
    """At exit the queued fitted compiles are cancelled and later ones refused: the calls still run in their ladder
    buckets, with no warning or notice, and no size is marked as one that cannot be fitted."""
    fitter = ThreadPoolExecutor(1)
    monkeypatch.setattr(vitjax.engine, "_FITTER", fitter)
    enc = _random_encoder(FIT_POLICY)
    engine = enc.parallel.engines[0]
    held = threading.Event()
    fitter.submit(held.wait, 60)  # the fitting thread busy: what comes next stays queued
    first, second = [(1, 10, 12), (1, 8, 10)], [(1, 10, 20)]  # 200 tokens (fitted 224), 200 in another bucket
    x, y = pixels_for(first, CFG, seed=5), pixels_for(second, CFG, seed=7)
    for _ in range(2):
        assert _bucket_rows(engine, x, first) == [256]
    fitter.shutdown(wait=False, cancel_futures=True)  # what `_drop_queued_fits` does
    held.set()
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "vitjax"):
        warnings.simplefilter("error")
        for _ in range(3):
            assert _bucket_rows(engine, x, first) == [256]
            assert _bucket_rows(engine, y, second) == [256]  # its fitted compile is refused at submit
    assert not engine._unfit and not engine._fitting and not caplog.records


EXIT_WITH_QUEUED_FITS = """
import threading, time
from vitjax import engine
running = threading.Event()
def fit(i):
    print("compiling", i, flush=True)
    running.set()
    time.sleep(2)
futures = [engine._FITTER.submit(fit, i) for i in range(4)]
running.wait(60)
"""


def test_fitted_compiles_still_queued_at_exit_are_dropped():
    """A process that is done does not wait for the fitted compiles still queued: only the running one finishes."""
    run = subprocess.run([sys.executable, "-c", EXIT_WITH_QUEUED_FITS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["compiling 0"]
    # Imported while the interpreter shuts down (an atexit hook of the caller's): no hook is left to add, no error.
    late = "import atexit, concurrent.futures.thread\natexit.register(lambda: __import__('vitjax.engine'))"
    run = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "Error" not in run.stderr, run.stderr[-2000:]


def test_bucketed_matches_unbucketed(enc):
    grids = REQUESTS[3]
    x = pixels_for(grids, CFG, seed=1)
    for got, ref in zip(enc.encode_patches(x, np.array(grids)), _unbucketed(enc, x, grids), strict=True):
        _close(got, ref)


def test_image_alone_and_in_a_full_bucket(enc):
    """The same image gives the same embedding alone (smallest bucket) and among others filling a bucket."""
    target = (1, 6, 8)
    others = [(1, 8, 8), (2, 4, 8), (1, 10, 8)]  # with the target: 48 + 64 + 64 + 80 = 256 tokens, 5 frames
    x_target = pixels_for([target], CFG, seed=2)
    alone = enc.encode_patches(x_target, np.array([target]))[0]
    grids = [others[0], target, *others[1:]]
    x_others = pixels_for(others, CFG, seed=3)
    split = layout.grid_tokens(others[0])
    x = np.concatenate([x_others[:split], x_target, x_others[split:]])
    assert POLICY.plan(grids) == [(Bucket(256, 8), [0, 1, 2, 3])]
    together = enc.encode_patches(x, np.array(grids))[1]
    _close(together, alone)


def test_no_compilation_in_steady_state(enc):
    """After warm-up, many varied requests inside the bucket set compile nothing at all (counted by JAX)."""
    enc.warmup([Bucket(t, s) for t in POLICY.tokens for s in POLICY.segments])
    built = enc.parallel.compiles
    compiled: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(lambda a: a * 3)(np.arange(7))  # the counter sees a compile...
        assert len(compiled) == 1
        compiled.clear()
        for seed, grids in enumerate(REQUESTS * 2):  # ...and sees none here
            outs = enc.encode_patches(pixels_for(grids, CFG, seed=seed), np.array(grids))
            assert [o.shape for o in outs] == [(layout.grid_tokens(g) // 4, CFG.output_width) for g in grids]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiled == []
    assert enc.parallel.compiles == built


def test_request_over_largest_bucket_is_split(enc):
    grids = [(1, 8, 12), (1, 10, 10), (2, 6, 6), (1, 2, 2), (1, 16, 18)]  # 96 + 100 + 72 + 4 + 288 = 560 tokens
    x = pixels_for(grids, CFG, seed=4)
    plan = POLICY.plan(grids)
    assert len(plan) == 3 and plan[-1][0] == Bucket(320, 1)  # the 288-token image has its own bucket
    got = enc.encode_patches(x, np.array(grids))
    row = 0
    for g, o in zip(grids, got, strict=True):
        n = layout.grid_tokens(g)
        assert o.shape == (n // 4, CFG.output_width)
        _close(o, enc.encode_patches(x[row : row + n], np.array([g]))[0])
        row += n


def test_device_resident_pixels(monkeypatch):
    """Pixels already on the device (the SGLang bridge's case) give the host path's outputs, and a new request
    size compiles nothing: full chunks are row views, the partial one is one executable per chunk size."""
    monkeypatch.setattr(vitjax.engine, "MAX_CHUNK_ROWS", 16)  # several chunks per call even at these tiny sizes
    enc = _random_encoder()
    before = vitjax.engine._partial_chunk._cache_size()
    enc.warmup()  # compiles the partial-chunk program too
    assert vitjax.engine._partial_chunk._cache_size() == before + 1
    for grids in REQUESTS:
        x = pixels_for(grids, CFG, seed=5)
        on_device = enc.encode_patches(jnp.asarray(x), np.array(grids))
        for a, b in zip(on_device, enc.encode_patches(x, np.array(grids)), strict=True):
            np.testing.assert_array_equal(a, b)
    # The 120+36-row request ends in a partial 16-row chunk (the others fill whole chunks): nothing compiled.
    assert vitjax.engine._partial_chunk._cache_size() == before + 1
    # Rows of another dtype (integers here) on the device go the host path, as float32, at every size.
    levels = np.random.default_rng(7).integers(0, 255, (156, CFG.patch_dim)).astype(np.int32)
    grids = REQUESTS[5]  # 120 + 36 rows: whole chunks and a partial one
    assert sum(t * h * w for t, h, w in grids) == 156
    on_device = enc.encode_patches(jnp.asarray(levels), np.array(grids))
    for a, b in zip(on_device, enc.encode_patches(levels.astype(np.float32), np.array(grids)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_levels_on_the_device_give_what_host_levels_give(monkeypatch):
    """uint8 levels (`encode_patches(levels=True)`) already on the device are read in place as float rows are (row
    views, a partial chunk), or through the host below a chunk: the outputs are the host levels', which are the
    bf16 rows' (the same values, mapped on the device)."""
    monkeypatch.setattr(vitjax.engine, "MAX_CHUNK_ROWS", 16)
    enc = _random_encoder(dtype="bfloat16")
    grids = REQUESTS[5]  # 120 + 36 rows: whole chunks and a partial one
    levels = np.random.default_rng(7).integers(0, 256, (156, CFG.patch_dim), dtype=np.uint8)
    values = vitjax.preprocess.TABLES["pil"].astype(jnp.bfloat16)[levels]
    want = enc.encode_patches(values, np.array(grids))
    for rows in (levels, jnp.asarray(levels), jnp.asarray(levels[:12])):
        given = np.array(grids) if len(rows) == 156 else np.array([(1, 2, 6)])
        got = enc.encode_patches(rows, given, levels=True)
        ref = want if len(rows) == 156 else enc.encode_patches(values[:12], given)
        for a, b in zip(got, ref, strict=True):
            np.testing.assert_array_equal(a, b)


def test_call_layouts_stay_on_the_device(monkeypatch):
    """A call layout is copied to the device once and reused while among the `LAYOUT_CACHE` most recent; an
    evicted one is copied again. Its arrays are the host layout's, and the outputs do not change."""
    monkeypatch.setattr(vitjax.engine, "LAYOUT_CACHE", 2)
    enc = _random_encoder()
    engine = enc.parallel.engines[0]
    grids = REQUESTS[2]
    x = pixels_for(grids, CFG, seed=6)
    first = [np.asarray(o) for o in enc.encode_patches(x, np.array(grids))]
    ((bucket, _),) = POLICY.plan(grids)
    key = (tuple(grids), bucket)
    held = engine._layouts[key]
    packed = layout.pack(grids, *bucket, side=CFG.grid_side, merge=CFG.spatial_merge_size)
    for device, host in zip(held, packed, strict=True):
        np.testing.assert_array_equal(device, host)
    again = enc.encode_patches(x, np.array(grids))
    assert engine._layouts[key] is held
    for other in (REQUESTS[0], REQUESTS[1]):
        enc.encode_patches(pixels_for(other, CFG, seed=7), np.array(other))
    assert len(engine._layouts) == 2 and key not in engine._layouts
    evicted = enc.encode_patches(x, np.array(grids))
    assert engine._layouts[key] is not held
    for a, b, c in zip(first, again, evicted, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_engines_know_whether_the_path_was_named(monkeypatch):
    """Each bucket's executable asks `bucket_implementation`, told whether the encoder's path was chosen for the
    machine or named (by the caller or `$VITJAX_ATTENTION`)."""
    asked = []

    def record(impl, segments, automatic):
        asked.append((impl, segments, automatic))
        return impl

    monkeypatch.setattr(vitjax.engine, "bucket_implementation", record)
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    _random_encoder().parallel.engines[0].executable(Bucket(64, 8))
    _random_encoder(attention="reference").parallel.engines[0].executable(Bucket(64, 8))
    monkeypatch.setenv(attention.ENV_VAR, "reference")
    _random_encoder().parallel.engines[0].executable(Bucket(64, 8))
    assert asked == [("reference", 8, True), ("reference", 8, False), ("reference", 8, False)]


def test_compilation_cache_directory(monkeypatch, tmp_path):
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        monkeypatch.setenv("VITJAX_CACHE_DIR", "off")
        assert enable_compilation_cache() is None
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
        monkeypatch.setenv("VITJAX_CACHE_DIR", str(tmp_path))
        # part files of entries being written: a killed process's (old) goes; a live writer's and entries stay
        killed, live, entry = tmp_path / f".{'0' * 32}.part", tmp_path / f".{'a' * 32}.part", tmp_path / "key-cache"
        for path in (killed, live, entry):
            path.write_bytes(b"x")
        hour_ago = time.time() - vitjax.leftovers.STALE_SECONDS - 1
        for path in (killed, entry):
            os.utime(path, (hour_ago, hour_ago))
        assert enable_compilation_cache() == str(tmp_path) == jax.config.jax_compilation_cache_dir
        assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, entry.name]
        # buckets that compile in under JAX's default second are kept too
        assert jax.config.jax_persistent_cache_min_compile_time_secs == vitjax.engine.CACHE_MIN_COMPILE_SECONDS < 1
        jax.config.update("jax_compilation_cache_dir", "/somewhere/of/the/users")
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 3.0)
        assert enable_compilation_cache() == "/somewhere/of/the/users"  # a user's own setting is kept
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 3.0
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_cache_entries_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A JAX cache entry appears only once it is whole, renamed onto its place (processes writing one entry in place
    at once left it corrupt, bench/cache_race.py): a write cut short leaves neither the entry nor its part file, a
    written one holds exactly its bytes, and one that exists is not written again."""
    from jax._src.lru_cache import LRUCache

    monkeypatch.setattr(LRUCache, "put", LRUCache.put)  # JAX's own again after the test, unless it was vitjax's
    vitjax.engine.whole_cache_writes()
    cache = LRUCache(str(tmp_path), max_size=-1)

    def cut_short(part, entry):
        raise OSError("No space left on device")

    with monkeypatch.context() as m:
        m.setattr(vitjax.engine.os, "replace", cut_short)
        with pytest.raises(OSError, match="No space left"):
            cache.put("bucket", b"x" * 1000)
    assert list(tmp_path.iterdir()) == []
    cache.put("bucket", b"y" * 1000)
    cache.put("bucket", b"z" * 10)  # there already: kept
    assert [p.name for p in tmp_path.iterdir()] == ["bucket-cache"] and cache.get("bucket") == b"y" * 1000


def test_a_bucket_needed_by_several_threads_at_once_compiles_once():
    """Requests arriving together on a cold encoder (no warm-up) that need one bucket: one compile, the others wait
    for it (each used to compile its own, a second or more apiece on a GPU)."""
    enc = _random_encoder()
    grids = [[(1, 4, 4)], [(1, 4, 6)], [(1, 6, 6)], [(1, 2, 8)]]  # 16-36 tokens: all in the 64-token bucket
    start = threading.Barrier(len(grids))

    def encode(grid):
        x = pixels_for(grid, CFG, seed=1)
        start.wait()
        return np.asarray(enc.encode_patches(x, np.array(grid))[0])

    with ThreadPoolExecutor(len(grids)) as pool:
        together = list(pool.map(encode, grids))
    assert enc.parallel.compiles == 1
    for grid, got in zip(grids, together, strict=True):
        np.testing.assert_array_equal(
            got, np.asarray(enc.encode_patches(pixels_for(grid, CFG, seed=1), np.array(grid))[0])
        )


def test_default_warmup_compiles_what_encode_sends():
    """A bf16 tower's `encode` sends uint8 levels (PIL and videos): the default warm-up compiles those, so the
    first request compiles nothing; float32 rows (`encode_patches` of HF's pixel_values) are another program."""
    shapes = nnx.to_pure_dict(nnx.state(abstract_tower(CFG, jnp.float32)))
    params = jax.tree.map(lambda s: np.full(s.shape, 0.01, np.float32), shapes)
    enc = vitjax.Encoder.from_params(CFG, params, dtype="bfloat16", buckets=BucketPolicy(tokens=(64,), segments=(2,)))
    enc.warmup(run=False)
    assert [key[1].name for key in enc.parallel.engines[0]._executables] == ["uint8"]
    image = np.random.default_rng(0).integers(0, 256, (64, 96, 3), np.uint8)
    (out,) = enc.encode([image], min_pixels=32 * 32, max_pixels=64 * 96)
    assert out.grid_thw == (1, 4, 6) and enc.parallel.compiles == 1
    enc.warmup(pixel_dtype="float32", run=False)
    assert enc.parallel.compiles == 2
    with pytest.raises(ValueError, match="got float32 rows"):
        enc.warmup(pixel_dtype="float32", levels=True)
    assert enc.parallel.compiles == 2
    fresh = vitjax.Encoder.from_params(CFG, params, dtype="bfloat16", buckets=BucketPolicy(tokens=(64,), segments=(2,)))
    fresh.warmup(pixel_dtype="uint8", run=False)  # integer rows named: the float32 program they run in
    assert [key[1].name for key in fresh.parallel.engines[0]._executables] == ["float32"]
    fresh.warmup(levels=True, run=False)  # `encode_patches(levels=True)`'s, which are encode's
    assert sorted(key[1].name for key in fresh.parallel.engines[0]._executables) == ["float32", "uint8"]
    fresh.encode_patches(np.zeros((64, CFG.patch_dim), np.uint8), np.array([(1, 8, 8)]), levels=True)
    assert fresh.parallel.compiles == 2
    fp32 = vitjax.Encoder.from_params(CFG, params, dtype="float32", buckets=BucketPolicy(tokens=(64,), segments=(2,)))
    with pytest.raises(ValueError, match="got float32 tower"):
        fp32.warmup(levels=True)
    assert fp32.parallel.compiles == 0


def test_buckets_named_for_a_warm_up_are_refused_by_name_before_any_compile():
    enc = _random_encoder(dtype="bfloat16")
    for bad, match in [
        ((0, 1), r"bucket \(0, 1\): tokens and segments must be positive"),
        ((512, 0), "bucket"),
        ((66, 1), "a multiple of 4"),
        ((64.0, 1), "positive integers"),
        (64, r"\(tokens, segments\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            enc.warmup([Bucket(64, 1), bad], run=False)
    assert enc.parallel.compiles == 0


def test_a_warm_up_for_dali_compiles_both_pixel_dtypes_of_buckets_given_once():
    """Where the default decoder is DALI (a GPU with DALI installed), a bf16 tower's warm-up compiles the float32
    programs DALI's rows need beside the levels ones, also for buckets given as a generator (read once per dtype)."""
    enc = _random_encoder(dtype="bfloat16")
    enc.resolve_decoder = lambda decoder="auto": "dali"
    enc.warmup((b for b in [Bucket(64, 1)]), run=False)
    dtypes = sorted(key[1].name for key in enc.parallel.engines[0]._executables)
    assert dtypes == ["float32", "uint8"] and enc.parallel.compiles == 2


def _returned_within(call, seconds: float) -> list:
    """`[call()]`, or [] where it has not returned after `seconds` (left waiting on a daemon thread)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    return out


def test_an_interrupt_anywhere_in_a_compile_leaves_no_bucket_compiling(monkeypatch):
    """Ctrl-C lands between any two lines. Wherever it lands in `Engine.executable` before its cleanup, no bucket is
    left marked as compiling: one was, where it landed just past the compile, and every later call needing that
    bucket waited on it forever."""
    engine = _random_encoder().parallel.engines[0]
    monkeypatch.setattr(engine, "_compile", lambda *key: f"compiled {key[0].tokens}")
    code = vitjax.engine.Engine.executable.__code__
    source, first = inspect.getsourcelines(vitjax.engine.Engine.executable)
    cleanup = first + next((i for i, text in enumerate(source) if text.strip().startswith("finally:")), len(source))
    interrupted = []
    for line in sorted({line for *_, line in code.co_lines() if line is not None and first < line < cleanup}):
        engine._executables.clear()

        def trace(frame, event, arg, line=line):
            if event == "line" and frame.f_lineno == line and line not in interrupted:
                interrupted.append(line)
                raise KeyboardInterrupt
            return trace

        sys.settrace(lambda frame, event, arg: trace if frame.f_code is code else None)
        try:
            engine.executable(Bucket(64, 8))
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        assert engine._building == {}, line
        assert _returned_within(lambda: engine.executable(Bucket(64, 8)), 10) == ["compiled 64"], line
    assert len(interrupted) >= 8  # the lines a first call runs


def test_a_call_waiting_on_an_interrupted_compile_compiles_the_bucket_itself(monkeypatch):
    """Ctrl-C reaches the main thread only: a request on another thread that waits on the main thread's compile of
    its bucket compiles it itself. It was handed the main thread's KeyboardInterrupt, failing a request nobody
    interrupted (and one that a server's `except Exception` does not catch)."""
    engine = _random_encoder().parallel.engines[0]
    key = (Bucket(64, 8), np.dtype(np.float32), 0)
    caller, results = threading.current_thread(), []
    other = threading.Thread(target=lambda: results.append(engine.executable(Bucket(64, 8))), daemon=True)

    def compile_(*args):
        if threading.current_thread() is not caller:
            return "compiled by the waiting call"
        other.start()
        while not engine._building[key]._condition._waiters:  # until the other call waits on this compile
            time.sleep(0.01)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_compile", compile_)
    with pytest.raises(KeyboardInterrupt):
        engine.executable(Bucket(64, 8))
    other.join(10)
    assert results == ["compiled by the waiting call"] and engine.compiles == 1 and engine._building == {}


def test_a_second_interrupt_while_an_encode_stops_still_gives_up_its_claims(monkeypatch):
    """After Ctrl-C an encode waits (seconds, on a GPU) for its dispatch thread before giving up its images' claims;
    a second Ctrl-C in that wait left them pending, and every later encode of those images waited forever."""
    enc = _random_encoder()
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)

    class Dispatcher(ThreadPoolExecutor):
        def shutdown(self, wait=True, *, cancel_futures=False):
            super().shutdown(wait, cancel_futures=cancel_futures)
            if cancel_futures:  # the encode is stopping
                raise KeyboardInterrupt("the second")

    def first(*args):
        raise KeyboardInterrupt("the first")

    with monkeypatch.context() as m:
        m.setattr(vitjax.encoder, "ThreadPoolExecutor", Dispatcher)
        m.setattr(enc, "_dispatch", first)
        with pytest.raises(KeyboardInterrupt, match="the second"):
            enc.encode([image], min_pixels=64 * 64)
    (out,) = _returned_within(lambda: enc.encode([image], min_pixels=64 * 64), 60)[0]
    assert out.grid_thw == (1, 4, 4) and enc.images_encoded == 1
