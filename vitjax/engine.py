"""The table of ahead-of-time executables: an `Engine` compiles each bucket shape (`vitjax.buckets`) and runs the
tower's calls in them.

A process compiles each bucket once, ahead of time at warm-up or on first use, loads it from the persistent
compilation cache when another process compiled it before, and never compiles one again (a fitted bucket dropped
from its bounded table may be compiled again, after twice as many calls each time it is dropped, so sizes rotating
through more than the table holds do not keep the fitting thread compiling).

A size the ladder fits loosely gets a tighter bucket once it repeats: the second call of a size starts compiling
a bucket of its tokens rounded up to `BucketPolicy.fit_granule` on a background thread, and later calls run there
(never compiling on the request path; a serving process sees the same sizes again and again).

Host pixels travel in fixed-size row chunks (views of the caller's array, only the last partial chunk
copied) and are concatenated on the device, so neither the host nor the device does a shape-dependent
pad. Per-image results are zero-copy row views of a call's packed output on the device (`vitjax.row_views`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import inspect
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from numpy.typing import DTypeLike

from vitjax import layout
from vitjax.attention import Segments, bucket_implementation
from vitjax.buckets import Bucket, BucketPolicy
from vitjax.config import VisionConfig
from vitjax.leftovers import remove_stale
from vitjax.model import TowerInputs
from vitjax.notices import notice_once
from vitjax.preprocess import LEVELS, TABLES
from vitjax.row_views import row_views

CACHE_ENV = "VITJAX_CACHE_DIR"
# JAX persists only programs that took at least this long to compile (its default: 1 s). An 8B bucket compiles in
# 0.6-1.5 s on an H200, so most were compiled again by every new process; small helper programs stay out.
CACHE_MIN_COMPILE_SECONDS = 0.2
# The file a cache entry is written to before its rename: short (a key may be ~250 bytes), never read by JAX.
PART_PATTERN = ".*.part"
# Host pixels are sent in chunks of at most this many rows (a divisor of the bucket's tokens), as given
# when in one of these dtypes (or as uint8 levels, `Engine.run`), else as float32.
MAX_CHUNK_ROWS = 2048
PIXEL_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
# Device copies of the most recent call layouts kept per engine: a new copy costs the host ~1 ms before the call
# can start, and a serving process sees the same image sizes again and again (bench/NOTES.md).
LAYOUT_CACHE = 16
# The call of a size that starts its fitted bucket's compile (`BucketPolicy.fitted`): its second.
FIT_AFTER = 2
# Fitted executables kept per engine (least recently used dropped; a size dropped d times needs FIT_AFTER * 2**d calls
# to compile again), and call sizes remembered toward that (and their drops).
FITTED_EXECUTABLES = 16
FIT_SIGHTINGS = 256
# Fitted compiles queued or running at once per engine: sizes that come faster than one thread compiles wait for
# their next sighting rather than queue without end.
FIT_QUEUE = 16
# A fitted compile traces the tower in Python beside the calls being served. Each time a serving thread lets go of
# Python's lock (a device call, a wait) the tracing thread keeps it for the interpreter's switch interval, 5 ms by
# default, before handing it back: on an H100 the call that started a compile took +20 to +125 ms (4-32 720p images)
# and it with the next calls +50 to +360 ms. While a fitted compile runs the interval is at most this instead: +1 to
# +14 ms and -1 to +70 ms; the compile takes up to 50% longer (bench/NOTES.md).
FIT_SWITCH_INTERVAL = 0.0001
# Per-executable XLA options (the user's global flags stay untouched): cuBLASLt rather than XLA's Triton
# GEMMs fuses the bias and the MLP's GELU into the matmuls: -6% tower time on an H200 (bench/NOTES.md).
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": True}


def enable_compilation_cache() -> str | None:
    """Turn on XLA's persistent compilation cache so a second process starts warm; returns its directory.

    A directory the user configured for JAX is kept, with their settings. Otherwise `$VITJAX_CACHE_DIR`, else
    `~/.cache/vitjax/xla` (under `$XDG_CACHE_HOME` if set), keeping programs that compiled in at least
    `CACHE_MIN_COMPILE_SECONDS`, each written whole (`whole_cache_writes`; the part files of writers killed
    meanwhile are removed here); `VITJAX_CACHE_DIR=off` disables it.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = os.environ.get(CACHE_ENV)
    if path is not None and path.strip().lower() in ("", "0", "off", "none"):
        return None
    if path is None:
        path = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vitjax" / "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)
    whole_cache_writes()
    remove_stale(path, PART_PATTERN)
    return path


def whole_cache_writes() -> None:
    """JAX's persistent cache writes an entry in place. Processes that compile one bucket at once (SGLang's ranks as
    they start) then write it together, and left it corrupt in 5-11 of 60 two-process writes; JAX reads such an entry,
    warns and compiles past it at every start, never writing it again (bench/cache_race.py, bench/NOTES.md). Here an
    entry is written to a file of its own, synced and renamed onto its place, so it is whole or absent. Private: JAX's
    `LRUCache.put` without a size bound (with one JAX locks its files itself) on a local folder, checked on JAX 0.10.2
    and 0.11.2; a JAX whose cache differs keeps its own `put`."""
    from jax._src import lru_cache

    put = lru_cache.LRUCache.put
    known = hasattr(lru_cache, "_is_local_filesystem") and hasattr(lru_cache, "_CACHE_SUFFIX")
    if getattr(put, "whole", False) or not known or list(inspect.signature(put).parameters) != ["self", "key", "value"]:
        return

    def put_whole(self, key: str, value: bytes) -> None:
        folder = str(self.path)
        if self.eviction_enabled or not key or not lru_cache._is_local_filesystem(folder):  # noqa: SLF001
            return put(self, key, value)
        entry = os.path.join(folder, f"{key}{lru_cache._CACHE_SUFFIX}")  # noqa: SLF001
        if os.path.exists(entry):
            return None
        part = os.path.join(folder, PART_PATTERN.replace("*", uuid.uuid4().hex))
        try:
            with open(part, "xb") as f:  # the user's umask, as JAX's own write
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, entry)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        return None

    put_whole.whole = True
    lru_cache.LRUCache.put = put_whole


class Call(NamedTuple):
    """One dispatched tower call: its packed output on the device and where each image's rows are."""

    output: jax.Array  # [bucket tokens / 4, output width]
    images: list[int]  # indices into the request
    spans: list[tuple[int, int]]  # (first output row, rows) per image
    bucket: Bucket  # the shape it ran in (the ladder's, or a fitted one)


def _program(
    graph: nnx.GraphDef,
    impl: str,
    max_length: int,
    seq_axis: str | None,
    state: nnx.State,
    chunks: tuple[jax.Array, ...],
    pos_index: jax.Array,
    pos_weight: jax.Array,
    rope_pos: jax.Array,
    ids: jax.Array,
    starts: jax.Array,
    lengths: jax.Array,
) -> jax.Array:
    """The bucket executable: pixel chunks and packed layout in, merged tokens out. Under sequence parallelism
    it runs per device on that device's tokens (the segment arrays stay whole) and ends with an all-gather, so
    every device holds the whole output (an NCCL gather; copying a split array to one device is far slower).
    Chunks of `LEVELS` become HF's values here, in the tower's dtype (16 bits: both processors' tables agree)."""
    pixels = jnp.concatenate(chunks) if len(chunks) > 1 else chunks[0]
    inputs = TowerInputs(pos_index, pos_weight, rope_pos, Segments(ids, starts, lengths, max_length, seq_axis))
    tower = nnx.merge(graph, state)
    if pixels.dtype == LEVELS:
        pixels = jnp.asarray(TABLES["pil"], tower.dtype)[pixels]
    out = tower(pixels, inputs, impl)
    return out if seq_axis is None else jax.lax.all_gather(out, seq_axis, tiled=True)


class Engine:
    """Runs the tower on bucketed calls through a table of ahead-of-time compiled executables.

    It runs on one device, or on a group of devices with Ulysses sequence parallelism: each device holds
    the weights and a contiguous 1/n of every call's tokens (of the pixels, the layout and the activations),
    and around attention an all-to-all gives each device all tokens of 1/n of the heads. Outputs are
    gathered on the group's first device. With `automatic` (`impl` was chosen for the machine, not named) each
    bucket runs `attention.bucket_implementation`'s path.
    """

    def __init__(
        self,
        cfg: VisionConfig,
        graph: nnx.GraphDef,
        state: nnx.State,
        impl: str,
        policy: BucketPolicy | None = None,
        devices: Sequence[jax.Device] | None = None,
        automatic: bool = False,
    ):
        self.cfg, self.impl, self.automatic = cfg, impl, automatic
        self.policy = policy or BucketPolicy()
        self.devices = list(devices or jax.local_devices()[:1])
        n = len(self.devices)  # `parallel.device_groups` made it divide the heads
        self.policy.check_group(n)
        if n == 1:
            self._mesh = None
            self._split = self._whole = jax.sharding.SingleDeviceSharding(self.devices[0])
        else:
            self._mesh = jax.sharding.Mesh(np.array(self.devices), ("seq",))
            self._split = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec("seq"))
            self._whole = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())
        self._graph, self._state = graph, self.placed(state)
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self._zero_chunks: dict[tuple[jax.Device, int, np.dtype], jax.Array] = {}
        self._counts: dict[int, jax.Array] = {}
        self._layouts: collections.OrderedDict[tuple, tuple[jax.Array, ...]] = collections.OrderedDict()
        self._sightings: collections.OrderedDict[tuple, int] = collections.OrderedDict()  # fitted key -> calls
        self._drops: collections.OrderedDict[tuple, int] = collections.OrderedDict()  # fitted key -> times dropped
        self._fitting: dict[tuple, concurrent.futures.Future] = {}  # fitted keys being compiled
        self._fitted: collections.OrderedDict[tuple, None] = collections.OrderedDict()  # in `_executables`, LRU
        self._unfit: set[tuple] = set()  # fitted keys that failed to compile: their calls stay on the ladder
        self._building: dict[tuple, concurrent.futures.Future] = {}  # keys a caller is compiling in `executable`
        self._fit_lock = threading.Lock()  # over the six tables above and `_executables`
        self.compiles = 0  # executables built by this engine (from scratch or from the persistent cache)
        enable_compilation_cache()

    def placed(self, state: nnx.State) -> nnx.State:
        """`state` on this engine's devices (no copy when already there)."""
        return jax.device_put(state, self._whole)

    def set_state(self, state: nnx.State) -> None:
        """New weights of the same shapes: every executable takes them as an argument, so none is rebuilt."""
        self._state = self.placed(state)

    def _max_length(self, bucket: Bucket, longest_frame: int) -> int:
        """The padded batch's slot length (`BucketPolicy.padded_length`; packed paths: unused, 0). So the padded path
        compiles per (bucket, slot length) on first use; warm-up guesses equal frames."""
        return self.policy.padded_length(bucket, longest_frame) if self.impl == "cudnn_padded" else 0

    def _chunk_rows(self, tokens: int) -> int:
        """Rows per pixel chunk: a divisor of each device's share of the bucket."""
        n = len(self.devices)
        if tokens % (4 * n):
            raise ValueError(f"a bucket of {tokens} tokens does not split over {n} devices in whole 2x2 merge groups")
        return math.gcd(tokens // n, MAX_CHUNK_ROWS)

    def executable(self, bucket: Bucket, pixel_dtype: np.dtype = np.float32, max_length: int = 0):
        """The compiled program of a bucket, built on first use, once: calls that need it meanwhile (other threads'
        requests, a warm-up beside serving) wait for that compile instead of each running their own."""
        key = (Bucket(*bucket), np.dtype(pixel_dtype), max_length)
        with self._fit_lock:
            if (compiled := self._executables.get(key)) is not None:
                return compiled
            fitting = self._fitting.get(key)
        if fitting is not None and (compiled := self._take_up(key, fitting)) is not None:
            return compiled
        mine = concurrent.futures.Future()
        try:
            while True:
                with self._fit_lock:
                    if (compiled := self._executables.get(key)) is not None:
                        return compiled
                    building = self._building.setdefault(key, mine)
                if building is mine:
                    break
                try:
                    return building.result()
                except BaseException as e:
                    # The compiling call was interrupted (Ctrl-C, raised in the main thread): not this call's failure,
                    # so this one compiles. An error, or this call's own interrupt, is raised.
                    if isinstance(e, Exception) or not building.done() or building.exception() is not e:
                        raise
            compiled = self._compile(*key)
            with self._fit_lock:
                self._executables[key] = compiled
                self.compiles += 1
            mine.set_result(compiled)
            return compiled
        except BaseException as e:  # calls waiting get the same error (an interrupt: they compile); later ones retry
            self._built(key, mine)  # first: a waiting call that compiles must not find this compile still there
            if not mine.done():
                mine.set_exception(e)
            raise
        finally:  # also where an interrupt came between two steps: a key left building would hang every later call
            self._built(key, mine)

    def _built(self, key: tuple, building: concurrent.futures.Future) -> None:
        with self._fit_lock:
            if self._building.get(key) is building:
                del self._building[key]

    def _take_up(self, key: tuple, fitting: concurrent.futures.Future) -> jax.stages.Compiled | None:
        """A fitted bucket a warm-up names, compiling in the background: that compile, waited for and kept as the
        warm-up's own (outside the fitted bound); None where it failed (the warm-up then compiles it itself)."""
        try:
            compiled = fitting.result()
        except Exception:
            compiled = None
        with self._fit_lock:
            if self._fitting.get(key) is fitting:
                del self._fitting[key]
                self._sightings.pop(key, None)
                if compiled is not None:
                    self._executables[key] = compiled
                    self.compiles += 1
            self._fitted.pop(key, None)  # installed by a call meanwhile: kept now, as the warm-up's
        return compiled

    def _compile(self, bucket: Bucket, pixel_dtype: np.dtype, max_length: int) -> jax.stages.Compiled:
        """Lower and compile a bucket's program (reads the engine, changes nothing: fitted buckets compile on a
        background thread)."""
        t, m, n = bucket.tokens, bucket.segments, len(self.devices)
        chunk = self._chunk_rows(t)

        def spec(shape: tuple[int, ...], dtype, split: bool = True) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._split if split else self._whole)

        args = (
            self._state,
            (spec((n * chunk, self.cfg.patch_dim), pixel_dtype),) * (t // (n * chunk)),
            spec((t, 4), np.int32),
            spec((t, 4), np.float32),
            spec((t, 2), np.int32),
            spec((t,), np.int32, split=False),
            spec((m,), np.int32, split=False),
            spec((m,), np.int32, split=False),
        )
        seq_axis = None if self._mesh is None else "seq"
        impl = bucket_implementation(self.impl, m, self.automatic)
        fn = functools.partial(_program, self._graph, impl, max_length, seq_axis)
        if self._mesh is not None:
            P = jax.sharding.PartitionSpec
            fn = jax.shard_map(
                fn,
                mesh=self._mesh,
                in_specs=(P(), P("seq"), P("seq"), P("seq"), P("seq"), P(), P(), P()),
                out_specs=P(),
                check_vma=False,  # the tower's scan carries start as unsharded zeros; only shapes matter here
            )
        options = COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
        return jax.jit(fn).lower(*args).compile(compiler_options=options)

    def _fit(
        self, bucket: Bucket, rows: int, pixel_dtype: np.dtype, longest: int, wanted: list[tuple]
    ) -> tuple[tuple[Bucket, np.dtype, int], jax.stages.Compiled | None]:
        """The executable key a call of `rows` in `bucket` runs under, and for a fitted key its executable (taken
        under the lock, so no other call can evict it first): its fitted bucket's (`BucketPolicy.fitted`) once
        that is compiled, else the ladder bucket's. The `FIT_AFTER`-th call of a size (doubled each time its fitted
        executable was dropped) adds the fitted key to `wanted`, compiled on a background thread once the request is
        dispatched (`run`)."""
        ladder = (bucket, pixel_dtype, self._max_length(bucket, longest)), None
        fitted = self.policy.fitted(bucket, rows)
        if fitted is None or fitted.tokens % (4 * len(self.devices)):
            return ladder
        key = (fitted, pixel_dtype, self._max_length(fitted, longest))
        with self._fit_lock:  # calls from several threads share these tables
            if key in self._fitted:
                self._fitted.move_to_end(key)
                return key, self._executables[key]
            if key in self._executables:  # compiled by a warm-up that named it
                return key, self._executables[key]
            future = self._fitting.get(key)
            if future is None:
                seen = self._sightings[key] = self._sightings.pop(key, 0) + 1
                while len(self._sightings) > FIT_SIGHTINGS:
                    self._sightings.popitem(last=False)
                if seen >= FIT_AFTER << self._drops.get(key, 0) and key not in self._unfit:
                    wanted.append(key)
                return ladder
            if not future.done() or not self._install(key):
                return ladder
            return key, self._executables[key]

    def _install(self, key: tuple) -> bool:
        """Move a finished fitted compile from `_fitting` into `_executables` (the least recently used fitted one
        dropped past `FITTED_EXECUTABLES`), or into `_unfit` with a notice (`notices`) if it failed; under
        `_fit_lock`."""
        future = self._fitting.pop(key)
        self._sightings.pop(key, None)
        if key in self._executables:  # a warm-up compiled it meanwhile: that one stays, outside the fitted bound
            return True
        if future.cancelled():  # at exit (`_drop_queued_fits`): not a failure of the bucket
            return False
        try:
            self._executables[key] = future.result()
        except Exception as e:  # e.g. out of device memory while autotuning: the ladder's bucket still runs
            self._unfit.add(key)
            notice_once(__name__, f"no fitted bucket {key[0]} ({e}); its calls stay in their ladder bucket")
            return False
        self.compiles += 1
        self._fitted[key] = None
        while len(self._fitted) > FITTED_EXECUTABLES:
            dropped = self._fitted.popitem(last=False)[0]
            del self._executables[dropped]
            self._drops[dropped] = self._drops.pop(dropped, 0) + 1
            while len(self._drops) > FIT_SIGHTINGS:
                self._drops.popitem(last=False)
        return True

    def settle(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` seconds) for the fitted buckets being compiled; the next call of each size runs in
        it (benchmarks, tests). True when none is still compiling."""
        with self._fit_lock:
            pending = list(self._fitting.values())
        return not concurrent.futures.wait(pending, timeout).not_done

    def warmup(
        self,
        buckets: Iterable[Bucket] | None = None,
        pixel_dtype: DTypeLike = np.float32,
        run: bool = True,
        *,
        levels: bool = False,
    ) -> dict[Bucket, float]:
        """Compile (or load from the persistent cache) each bucket now, and with `run` execute it once on a
        near-empty call (first executions load kernels and build cuDNN plans); returns seconds per bucket. The
        programs are those `run` uses for rows of `pixel_dtype` (and `levels`)."""
        times = {}
        pixel_dtype = travel_dtype(pixel_dtype, levels)
        for b in self.policy.buckets() if buckets is None else buckets:
            b = Bucket(*b)
            start = time.perf_counter()
            exe = self.executable(b, pixel_dtype, self._max_length(b, b.tokens // b.segments))
            if run:
                grids = [(1, self.cfg.spatial_merge_size, self.cfg.spatial_merge_size)]
                rows = layout.grid_tokens(grids[0])
                pixels = np.zeros((rows, self.cfg.patch_dim), pixel_dtype)
                jax.block_until_ready(exe(self._state, *self._inputs(pixels, 0, rows, grids, b)))
                if len(self.devices) == 1:  # device-resident requests' partial chunk (else +0.1 s on first use)
                    window = np.zeros((self._chunk_rows(b.tokens), self.cfg.patch_dim), pixel_dtype)
                    jax.block_until_ready(
                        _partial_chunk(jax.device_put(window, self.devices[0]), *[self._count(0)] * 2)
                    )
            times[b] = time.perf_counter() - start
        return times

    def run(
        self,
        pixel_values: np.ndarray | jax.Array,
        grids: Sequence[layout.Grid],
        first_row: int = 0,
        *,
        levels: bool = False,
    ) -> list[Call]:
        """Dispatch every call of a request (asynchronously); outputs stay on the device. The request's pixel
        rows start at `first_row` of `pixel_values`; a host array is free for the caller to reuse on return.
        With `levels` the rows are uint8 levels (`preprocess.LEVELS`) that the program maps to HF's values, for a
        16-bit tower."""
        dtype = travel_dtype(pixel_values.dtype, levels)
        if isinstance(pixel_values, jax.Array) and (len(self.devices) > 1 or np.dtype(pixel_values.dtype) != dtype):
            # split over the group on the host, or made float32 there (once a request), like any host pixels
            pixel_values = np.asarray(pixel_values)
        if not isinstance(pixel_values, jax.Array):
            pixel_values = np.ascontiguousarray(pixel_values, dtype)
        elif pixel_values.devices() != {self.devices[0]}:  # elsewhere, or spread over several devices
            pixel_values = jax.device_put(pixel_values, self.devices[0])
        calls, wanted = [], []
        row = first_row
        for ladder_bucket, images in self.policy.plan(grids, padded=self.impl == "cudnn_padded"):
            call_grids = [grids[i] for i in images]
            rows = sum(layout.grid_tokens(g) for g in call_grids)
            key, fitted = self._fit(ladder_bucket, rows, dtype, max(g[1] * g[2] for g in call_grids), wanted)
            bucket = key[0]
            exe = fitted or self.executable(*key)
            output = exe(self._state, *self._inputs(pixel_values, row, rows, call_grids, bucket))
            if self._mesh is not None:  # replicated: keep the first device's copy
                output = next(s.data for s in output.addressable_shards if s.device == self.devices[0])
            calls.append(Call(output, images, layout.split_points(call_grids, self.cfg.merge_unit), bucket))
            row += rows
        # Fitted compiles start once the request is dispatched: their tracing holds Python's lock most of the time,
        # and started before the dispatch it held that back (on an H100 the call that started one took +140-380 ms);
        # started here it overlaps the call's device work, which hides it on large calls of few images (NOTES).
        if wanted:
            with self._fit_lock:
                # Finished compiles whose size has not come back are installed now (held to FITTED_EXECUTABLES like
                # any), so `_fitting` holds only queued and running ones, at most FIT_QUEUE; a key another thread's
                # compile already put in place, or a warm-up is compiling, is not compiled again.
                for key in [k for k, f in self._fitting.items() if f.done()]:
                    self._install(key)
                tables = (self._fitting, self._executables, self._building, self._unfit)
                for key in wanted:
                    if not any(key in table for table in tables) and len(self._fitting) < FIT_QUEUE:
                        try:
                            self._fitting[key] = _FITTER.submit(self._compile_beside_calls, *key)
                        except RuntimeError:  # the process is exiting: the call is served, its size is not fitted
                            break
        return calls

    def _compile_beside_calls(self, bucket: Bucket, pixel_dtype: np.dtype, max_length: int) -> jax.stages.Compiled:
        """`_compile` on the fitting thread, with Python's switch interval at most `FIT_SWITCH_INTERVAL` meanwhile so
        that the serving threads get the lock back soon (one fitting thread per process: nothing else nests this)."""
        previous = sys.getswitchinterval()
        sys.setswitchinterval(min(previous, FIT_SWITCH_INTERVAL))
        try:
            return self._compile(bucket, pixel_dtype, max_length)
        finally:
            sys.setswitchinterval(previous)

    def encode(
        self,
        pixel_values: np.ndarray | jax.Array,
        grids: Sequence[layout.Grid],
        first_row: int = 0,
        *,
        levels: bool = False,
    ) -> list[jax.Array]:
        """Per-image outputs in input order, on the device: zero-copy row views of each call's output."""
        outs: list[jax.Array] = [None] * len(grids)  # type: ignore[list-item]
        for call in self.run(pixel_values, grids, first_row, levels=levels):
            for i, view in zip(call.images, row_views(call.output, call.spans), strict=True):
                outs[i] = view
        return outs

    def _inputs(
        self, pixels: np.ndarray | jax.Array, row: int, rows: int, grids: Sequence[layout.Grid], bucket: Bucket
    ) -> tuple:
        """A call's executable arguments on the device(s): rows [row, row+rows) of the request's pixels as
        equal chunks, zero-padded to the bucket, and the packed layout of `grids` in `bucket`."""
        tokens, n = bucket.tokens, len(self.devices)
        chunk = self._chunk_rows(tokens)
        layout_args = self._layout(grids, bucket)
        if isinstance(pixels, jax.Array):
            if pixels.shape[0] >= chunk:
                return (self._device_pieces(pixels, row, rows, tokens, chunk), *layout_args)
            pixels = np.asarray(pixels)  # shorter than one chunk (at most 2048 rows): through the host
        dtype = np.dtype(pixels.dtype)  # the travel dtype (`run`)
        # JAX's CPU arrays alias a host array's memory where it is 64-byte aligned, and the tower reads it later: the
        # rows are copied, so the caller may rewrite its array once `run` returns (a GPU's `device_put` has read it by
        # then, bench/NOTES.md).
        own = self.devices[0].platform == "cpu"
        pieces = []  # host views of the request (on the CPU copies; the last partial chunk copied), None: padding
        for start in range(row, row + tokens, chunk):
            end = min(start + chunk, row + rows)
            if end - start == chunk:
                pieces.append(pixels[start:end].copy() if own else pixels[start:end])
            elif end > start:
                part = np.zeros((chunk, pixels.shape[1]), dtype)
                part[: end - start] = pixels[start:end]
                pieces.append(part)
            else:
                pieces.append(None)
        per_device = len(pieces) // n  # device d holds the pieces [d * per_device, (d + 1) * per_device)
        placed = [
            jax.device_put([self._zero(d, chunk, dtype) if p is None else p for p in pieces[i : i + per_device]], d)
            for d, i in zip(self.devices, range(0, len(pieces), per_device), strict=True)
        ]
        if n == 1:
            return (tuple(placed[0]), *layout_args)
        shape = (n * chunk, pixels.shape[1])  # global chunk j: piece j of every device, split over "seq"
        chunks = tuple(
            jax.make_array_from_single_device_arrays(shape, self._split, [on[j] for on in placed])
            for j in range(per_device)
        )
        return (chunks, *layout_args)

    def _layout(self, grids: Sequence[layout.Grid], bucket: Bucket) -> tuple[jax.Array, ...]:
        """The packed layout of a call on the device(s) (per token split over the group, per segment whole), one
        copy for each of the `LAYOUT_CACHE` most recently used layouts."""
        key = (tuple(tuple(g) for g in grids), bucket)
        args = self._layouts.pop(key, None)
        if args is None:
            packed = layout.pack(grids, *bucket, side=self.cfg.grid_side, merge=self.cfg.spatial_merge_size)
            args = tuple(jax.device_put(tuple(packed), (self._split,) * 3 + (self._whole,) * 3))
        self._layouts[key] = args
        while len(self._layouts) > LAYOUT_CACHE:
            self._layouts.popitem(last=False)
        return args

    def _device_pieces(self, pixels: jax.Array, row: int, rows: int, tokens: int, chunk: int) -> tuple:
        """Device-resident pixels (one device) as the call's chunks, with nothing compiled per request size: full
        chunks are zero-copy row views; a partial one is a chunk-sized window of the array rotated and masked
        by one executable per chunk size (the array holds at least one chunk)."""
        full, part = divmod(rows, chunk)
        spans = [(row + i * chunk, chunk) for i in range(full)]
        if part:  # the last rows: a whole chunk of the array that holds them, rotated and masked
            window = min(row + full * chunk, pixels.shape[0] - chunk)
            spans.append((window, chunk))
        pieces = row_views(pixels, spans)
        if part:
            pieces[-1] = _partial_chunk(pieces[-1], self._count(row + full * chunk - window), self._count(part))
        padding = tokens // chunk - len(pieces)
        return (*pieces, *[self._zero(self.devices[0], chunk, np.dtype(pixels.dtype))] * padding)

    def _count(self, value: int) -> jax.Array:
        """An int32 scalar kept on the engine's first device (fewer than 2 * MAX_CHUNK_ROWS of them): the partial
        chunk's offset and length, sent once rather than copied to the device before every call."""
        if value not in self._counts:
            self._counts[value] = jax.device_put(np.int32(value), self.devices[0])
        return self._counts[value]

    def _zero(self, device: jax.Device, rows: int, dtype: np.dtype) -> jax.Array:
        """A chunk of padding rows, kept on the device."""
        key = (device, rows, dtype)
        if key not in self._zero_chunks:
            self._zero_chunks[key] = jax.device_put(np.zeros((rows, self.cfg.patch_dim), dtype), device)
        return self._zero_chunks[key]


# The one background thread that compiles fitted buckets, for every engine of the process (started by the first).
_FITTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vitjax-fit")


def _drop_queued_fits() -> None:
    """At exit, the fitted compiles still queued are cancelled (a running one finishes): Python joins its worker
    threads at exit, and would otherwise run every queued compile first, for calls that will never come."""
    _FITTER.shutdown(wait=False, cancel_futures=True)


# Private: its hooks run before Python joins worker threads at exit (`atexit`'s after); checked on 3.11 and 3.12. It
# refuses once the interpreter is shutting down (an import then): nothing is left to serve.
with contextlib.suppress(RuntimeError):
    threading._register_atexit(_drop_queued_fits)  # noqa: SLF001


def travel_dtype(dtype: DTypeLike, levels: bool = False) -> np.dtype:
    """Pixels travel as given when float32/bfloat16/float16, else as float32; with `levels`, as `LEVELS`."""
    dtype = np.dtype(dtype)
    if levels:
        if dtype != LEVELS:
            raise ValueError(f"levels: pixel rows of uint8 levels expected, got {dtype}")
        return dtype
    return dtype if dtype in PIXEL_DTYPES else np.dtype(np.float32)


@jax.jit
def _partial_chunk(window: jax.Array, offset: jax.Array, valid: jax.Array) -> jax.Array:
    """Rows [offset, offset + valid) of `window` first, zeros after (offset and valid traced: one compile)."""
    rolled = jnp.roll(window, -offset, axis=0)
    return jnp.where(jnp.arange(window.shape[0])[:, None] < valid, rolled, 0)
