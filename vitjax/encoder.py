"""The user-facing Encoder: weights on the device, bucketed tower calls, and `encode` driving `vitjax.pipeline`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
import tqdm.auto
from flax import nnx
from numpy.typing import DTypeLike

from vitjax import dali, hub, layout, weights
from vitjax.attention import ENV_VAR, Segments, check_devices, default_implementation, named_implementation
from vitjax.buckets import Bucket, BucketPolicy, checked_bucket
from vitjax.cache import EmbeddingCache, check_max_bytes
from vitjax.config import VisionConfig
from vitjax.engine import Engine, travel_dtype
from vitjax.images import ImageInputError, expand_inputs
from vitjax.model import TowerInputs, VisionTower
from vitjax.parallel import DataParallel, device_groups, pick_devices
from vitjax.pipeline import DECODERS, Batch, Item, Pipeline
from vitjax.preprocess import LEVEL_TOWERS, LEVELS, MAX_PIXELS, MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS
from vitjax.settings import PIXEL_LIMIT, EncodeSettings

# The tower's compute dtypes: float16 as SGLang serves it too; float64 and integers are no tower's.
DTYPES = ("bfloat16", "float16", "float32")


def abstract_tower(cfg: VisionConfig, dtype: jnp.dtype) -> VisionTower:
    """The tower with shapes only (no memory, no compute): for parameter counts and weight loading."""
    return nnx.eval_shape(lambda: VisionTower(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def _forward(graph: nnx.GraphDef, state: nnx.State, pixels: jax.Array, inputs: TowerInputs, impl: str) -> jax.Array:
    return nnx.merge(graph, state)(pixels, inputs, impl)


@dataclass(frozen=True)
class Encoded:
    """One image's or video's tower output. `features` is what the tower wrote, on the device, untouched (SGLang's
    column layout); `embeds` and `deepstack` are the split Qwen3-VL's language model consumes."""

    name: str
    grid_thw: tuple[int, int, int]
    sha256: str  # the cache's content key: of the decoded pixels with their size (decoder "pil"), of the encoded
    # file (decoder "dali", a video file), or of the sampled frames (a video given as an array or frames)
    features: jax.Array  # [tokens, out_hidden * (1 + k)]: [merger | deepstack_0 | ... | deepstack_k-1]
    out_hidden: int
    decoder: str = "pil"  # the backend that made the pixels: "pil" (HF-exact), "dali" or "video" (HF-exact)

    @property
    def embeds(self) -> jax.Array:
        """[tokens, out_hidden]: the final merger's output."""
        return self.features[:, : self.out_hidden]

    @property
    def deepstack(self) -> jax.Array:
        """[k, tokens, out_hidden]: deepstack merger j's output at [j]."""
        tokens = self.features.shape[0]
        return self.features[:, self.out_hidden :].reshape(tokens, -1, self.out_hidden).transpose(1, 0, 2)


def tower_dtype(dtype: object) -> np.dtype:
    """The tower's dtype from its name or type, checked before any weight is read: one of `DTYPES`."""
    try:
        checked = jnp.dtype(dtype)
    except TypeError:
        checked = None
    if checked is None or checked.name not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: the tower runs in one of {', '.join(DTYPES)}")
    return checked


class Encoder:
    """Qwen3-VL vision tower: `encode(images)` or `encode_patches(pixel_values, grid_thw)`.

    `model_id` names the weights in the embedding cache's keys (a path, a seed); `cache_bytes` bounds
    the per-image cache (0 disables it); `devices` (a count, "all" or a list; default the first local
    device) each hold the weights: groups of `sequence_parallel` devices share every call's tokens
    (Ulysses), and the groups split each request's images between them (data parallel). `attention` names
    the path for every call (`vitjax.attention.IMPLEMENTATIONS`); by default it is chosen for the machine, and
    where that is fa4, buckets of many segments (a video's slices) run cuDNN's packed path. The flash paths (fa4,
    cuDNN) take 16-bit towers: a float32 one runs XLA's path, and naming a flash path for it is refused.
    """

    def __init__(
        self,
        cfg: VisionConfig,
        model: VisionTower,
        attention: str | None = None,
        model_id: str | None = None,
        cache_bytes: int = 1 << 30,
        buckets: BucketPolicy | None = None,
        devices: int | str | jax.Device | Sequence[jax.Device] | None = None,
        sequence_parallel: int = 1,
    ):
        self.cfg = cfg
        self.dtype = model.dtype
        # A 16-bit tower's `encode` sends its rows as uint8 levels, mapped to HF's values on the device: a quarter of
        # float32's bytes, and no lookup on the host.
        self._row_dtype = LEVELS if self.dtype in LEVEL_TOWERS else np.dtype(np.float32)
        picked = pick_devices(devices)
        # The automatic choice is for the process's default backend; CPU devices in a GPU process need XLA's. The
        # flash paths take 16-bit towers only: a float32 one runs XLA's.
        gpus = all(d.platform == "gpu" for d in picked)
        named = named_implementation(attention, self.dtype)  # the argument, else $VITJAX_ATTENTION
        self.attention = named or (default_implementation(self.dtype) if gpus else "reference")
        self.model_id = f"{model_id or uuid.uuid4()}:{self.dtype.name}"
        self.cache = EmbeddingCache(cache_bytes)
        self.images_encoded = 0
        self._graph, state = nnx.split(model)
        self._state = jax.device_put(state, picked[0])  # where the first engine runs (no copy when already there)
        self._forward = jax.jit(functools.partial(_forward, self._graph), static_argnames="impl")
        groups = device_groups(picked, sequence_parallel, cfg.num_heads)
        automatic = named is None
        engines = [Engine(cfg, self._graph, self._state, self.attention, buckets, group, automatic) for group in groups]
        self.parallel = DataParallel(engines)
        self._dali: dali.DaliRows | None = None  # built on first use of decoder="dali"
        self._dali_lock = threading.Lock()

    @classmethod
    def from_params(cls, cfg: VisionConfig, params: weights.Params, dtype: str = "bfloat16", **kw) -> Encoder:
        """Build from a nested parameter dict (as `weights.load_hf` returns), cast to `dtype`."""
        dtype = tower_dtype(dtype)
        first = _check_settings(cfg, dtype, kw)[0]  # built there: a GPU the encoder does not use gets nothing
        weights.check_params(params, cfg, "from_params")
        model = abstract_tower(cfg, dtype)
        state = nnx.state(model)
        nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jax.device_put(np.asarray(a, dtype), first), params))
        nnx.update(model, state)
        return cls(cfg, model, **kw)

    def params(self) -> weights.Params:
        """The weights as a nested dict of host arrays in the encoder's dtype (what `from_params` takes)."""
        return jax.tree.map(np.array, nnx.to_pure_dict(self._state))

    def set_params(self, params: weights.Params) -> None:
        """Replace the weights in place (same config; not while calls run): the compiled executables stay, and
        the embedding cache, which holds the old weights' results, is emptied."""
        weights.check_params(params, self.cfg, "set_params")
        old = nnx.to_pure_dict(self._state)
        placed = jax.tree.map(lambda a, o: jax.device_put(np.asarray(a, self.dtype), o.sharding), params, old)
        state = jax.tree.map(lambda x: x, self._state)  # the same tree, given the new leaves
        nnx.replace_by_pure_dict(state, placed)
        states = [engine.placed(state) for engine in self.parallel.engines]  # all copies made before any is used
        self._state = state
        for engine, placed_state in zip(self.parallel.engines, states, strict=True):
            engine.set_state(placed_state)
        self.cache.clear()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str = "bfloat16", progress: bool = False, **kw) -> Encoder:
        """Load an HF directory (config.json + *.safetensors), a directory written by `vitjax convert`, or a Hugging
        Face Hub id ("Qwen/Qwen3-VL-8B-Instruct": its config and vision shards, from the cache or fetched there,
        `vitjax.hub`)."""
        dtype = tower_dtype(dtype)
        named_implementation(kw.get("attention"), dtype)  # a path the dtype rules out: refused before any read
        cfg = VisionConfig.from_hf(hub.model_folder(path, True, progress))  # config.json, in either kind of folder
        _check_settings(cfg, dtype, kw)
        path = hub.model_folder(path, progress=progress)  # a hub model's weights are fetched once its settings passed
        if weights.is_orbax(path):
            cfg, params = weights.load_orbax(path)
        else:
            params = weights.load_hf(path, cfg, progress=progress)
        return cls.from_params(cfg, params, dtype, **{"model_id": str(Path(path).resolve()), **kw})

    @classmethod
    def random(cls, cfg: VisionConfig | str, seed: int = 0, dtype: str = "bfloat16", **kw) -> Encoder:
        """Random weights (smoke runs and benchmarks); `cfg` may be a preset name."""
        cfg = VisionConfig.preset(cfg) if isinstance(cfg, str) else cfg
        dtype = tower_dtype(dtype)
        first = _check_settings(cfg, dtype, kw)[0]
        kw.setdefault("model_id", f"random:{seed}:{cfg}")
        with jax.default_device(first):  # drawn there: a GPU the encoder does not use gets nothing
            model = VisionTower(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
        return cls(cfg, model, **kw)

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self._state))

    def check_inputs(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> list[layout.Grid]:
        """Validate dtype and shapes before anything reaches the device; return the grids as tuples."""
        dtype = np.dtype(pixel_values.dtype)
        if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
            raise ValueError(
                f"pixel_values: dtype {dtype}: need real numbers (floats or integers, as HF's processors give)"
            )
        return layout.check_patches(pixel_values.shape, grid_thw, self.cfg.patch_dim, self.cfg.spatial_merge_size)

    def warmup(
        self,
        buckets: Iterable[Bucket] | None = None,
        pixel_dtype: str | None = None,
        run: bool = True,
        *,
        levels: bool = False,
    ) -> dict[Bucket, float]:
        """Compile the bucket executables now (default: every bucket of the policy) or load them from the
        persistent compilation cache, and run each once; returns seconds per bucket. Executables are per pixel
        dtype: by default those `encode` sends are compiled (its host rows', uint8 levels for a 16-bit tower, and
        float32 as well where its default decoder is DALI); `encode_patches` callers name theirs (integers run as
        float32), or give `levels` for `encode_patches(levels=True)`."""
        if levels:
            self._check_levels(pixel_dtype)
            dtypes = {LEVELS}
        elif pixel_dtype is not None:
            dtypes = {travel_dtype(pixel_dtype)}
        else:
            dtypes = {self._row_dtype} | ({np.dtype(np.float32)} if self.resolve_decoder() == "dali" else set())
        buckets = None if buckets is None else [checked_bucket(b) for b in buckets]  # read once per dtype
        times: dict[Bucket, float] = {}
        for dtype in dtypes:  # `LEVELS` here is levels (a named uint8 became float32 above)
            for bucket, seconds in self.parallel.warmup(buckets, dtype, run, levels=dtype == LEVELS).items():
                times[bucket] = times.get(bucket, 0.0) + seconds
        return times

    def _check_levels(self, pixel_dtype: DTypeLike | None) -> None:
        """Refuse `levels=True` but for uint8 rows (or none named) into a 16-bit tower: in float32 HF's two processors
        map some levels an ulp apart."""
        if self.dtype not in LEVEL_TOWERS or (pixel_dtype is not None and np.dtype(pixel_dtype) != LEVELS):
            got = f"{self.dtype.name} tower" if self.dtype not in LEVEL_TOWERS else f"{np.dtype(pixel_dtype)} rows"
            raise ValueError(f"levels=True takes uint8 rows into a bfloat16 or float16 tower, got {got}")

    def run_packed(self, pixel_values: jax.Array | np.ndarray, packed: layout.Packed) -> jax.Array:
        """One unbucketed tower call on an already packed sequence (compiled per shape): `[T/4, output_width]`."""
        inputs = TowerInputs(
            jnp.asarray(packed.pos_index),
            jnp.asarray(packed.pos_weight),
            jnp.asarray(packed.rope_pos),
            Segments(*(jnp.asarray(a) for a in (packed.segment_ids, packed.segment_starts, packed.segment_lengths))),
        )
        return self._forward(self._state, jnp.asarray(pixel_values), inputs, impl=self.attention)

    def encode_patches(
        self, pixel_values: np.ndarray | jax.Array, grid_thw: np.ndarray, *, levels: bool = False
    ) -> list[jax.Array]:
        """Pixel rows (HF processor output, concatenated) -> per image/video `[t*h*w/4, output_width]`.

        Runs in bucketed calls of whole images (see `vitjax.buckets`), spread over the encoder's devices (see
        `vitjax.parallel`); results stay on the device that computed them, in input order. With `levels` the rows
        are uint8 levels before HF's rescale and normalize (as `preprocess_image` writes them into a uint8 `out`),
        mapped on the device; 16-bit towers only.
        """
        if not isinstance(pixel_values, jax.Array):
            pixel_values = np.asarray(pixel_values)
        if levels:
            self._check_levels(pixel_values.dtype)
        grids = self.check_inputs(pixel_values, grid_thw)
        return self.parallel.encode(pixel_values, grids, levels=levels)

    def encode(
        self,
        images: Iterable[object] | object,
        *,
        min_pixels: int = MIN_PIXELS,
        max_pixels: int = MAX_PIXELS,
        pixel_limit: int = PIXEL_LIMIT,
        batch_tokens: int | None = None,
        errors: str = "raise",
        progress: bool | tqdm.tqdm = False,
        decoder: str = "auto",
        video_min_pixels: int = VIDEO_MIN_PIXELS,
        video_max_pixels: int = VIDEO_MAX_PIXELS,
        fps: float | None = None,
        num_frames: int | None = None,
        image_processor_backend: str = "pil",
        workers: int | None = None,
    ) -> list[Encoded | ImageInputError]:
        """Images (paths, directories, bytes, data URIs, PIL images, uint8 arrays) and videos -> one `Encoded` each,
        in order.

        Videos are `vitjax.Video(...)` inputs (a file, a uint8 array [T, H, W, 3] or a frame list, with its own
        sampling) and paths with a video extension (also inside folders), sampled at `fps` or to `num_frames`
        (default: 2 frames per second, as HF); they are preprocessed as HF's `Qwen3VLVideoProcessor` does within
        `video_min_pixels` / `video_max_pixels` (`vitjax.preprocess.preprocess_video`) and come back with grid t =
        one per pair of sampled frames (decoder "video"). Their cache keys include the sampling and the pixel bounds.

        A driver over `vitjax.pipeline`: inputs are prepared (decoded, hashed, sized) in threads a bounded window
        ahead, looked up in the cache, and the misses' rows written straight into the buffer of the next tower
        call of at most `batch_tokens` patches per device (default `BATCH_TOKENS`; a larger image or video is a
        call of its own); calls are dispatched from a thread of their own, at most two in flight, so host memory
        does not grow with the number of images and the host's work overlaps the device's (also where a call's
        dispatch waits for the device, as a bucket with fa4's overflow check does). An image seen before (same
        pixels, settings and weights) comes from the cache; one that another thread is encoding right now is
        waited for; duplicates within a request are encoded once. Every setting is checked first
        (`vitjax.settings`: a `SettingError` names it). With `errors="return"` a bad input yields its
        `ImageInputError` in its slot and the rest are still encoded; with "raise" the first is raised, after
        the others are encoded and cached. `progress` shows a bar, or advances a caller's tqdm bar once an input
        (one bar over several calls). `decoder` picks the decode backend (see `resolve_decoder`); each
        result's `decoder` says which one made its pixels. Images get the rows of HF's image processor of
        `image_processor_backend`: "pil" (`Qwen2VLImageProcessorPil`, the default) or "torchvision"
        (`Qwen2VLImageProcessor`: what `AutoProcessor` in transformers 5 builds, run on the CPU); cache
        keys include it. `workers` threads decode and preprocess (default: one a core, up to 16).
        """
        video = {"video_min_pixels": video_min_pixels, "video_max_pixels": video_max_pixels}
        sampling = {"fps": fps, "num_frames": num_frames}
        checked = EncodeSettings(
            min_pixels,
            max_pixels,
            pixel_limit,
            batch_tokens,
            errors,
            progress,
            decoder,
            **video,
            **sampling,
            image_processor_backend=image_processor_backend,
            workers=workers,
        )
        settings = checked.checked(self.cfg)
        rows = self._dali_rows() if self.resolve_decoder(decoder) == "dali" else None
        items = expand_inputs(images)
        options = {"min_pixels": min_pixels, "max_pixels": max_pixels, "pixel_dtype": self._row_dtype, "dali": rows}
        options.update(video, **sampling, image_processor_backend=image_processor_backend, workers=workers)
        budget = settings.batch_tokens * len(self.parallel.engines)
        outcome: list[Item | ImageInputError] = []  # per input: its item (without pixels), or its error
        found: dict[tuple, Future | tuple[layout.Grid, jax.Array] | ImageInputError | None] = {}  # by cache key
        claimed: dict[tuple, Future] = {}  # cache keys this call must put or abandon, and their claims
        given = isinstance(progress, tqdm.tqdm)  # any tqdm bar: tqdm.auto's and notebook bars are subclasses
        shown = {"total": len(items), "desc": "encoding", "unit": "input", "disable": not progress}
        bar = progress if given else tqdm.auto.tqdm(**shown)
        lock = threading.Lock()  # the bar advances from the workers too, as each image's rows are made

        def advance() -> None:
            with lock:
                bar.update()

        with (
            Pipeline(self.cfg, **options) as pipe,
            ThreadPoolExecutor(1, thread_name_prefix="vitjax-dispatch") as dispatcher,
            contextlib.nullcontext() if given else bar,
        ):
            in_flight: deque[Future] = deque()
            try:
                open_batches: dict[bool, Batch] = {}  # host rows (PIL, videos) or DALI's, filled side by side
                for item in pipe.prepare(items):
                    key = None if isinstance(item, ImageInputError) else (self.model_id, *pipe.cache_key(item))
                    outcome.append(item if key is None else dataclasses.replace(item, fill=None, sample=None))
                    if key is None or key in found:
                        advance()
                        continue
                    found[key] = self.cache.claim(key, claimed)
                    if found[key] is not None:  # cached, or another thread is encoding it
                        advance()
                        continue
                    host = pipe.host(item)
                    if host in open_batches and not open_batches[host].fits(item):
                        self._dispatch(pipe, open_batches.pop(host), found, dispatcher, in_flight)
                    if host not in open_batches:
                        open_batches[host] = pipe.batch(max(budget, item.tokens), host)
                    open_batches[host].add(item, advance)
                    del item  # its decoded image goes once its rows are made
                for batch in open_batches.values():
                    self._dispatch(pipe, batch, found, dispatcher, in_flight)
                while in_flight:
                    jax.block_until_ready(in_flight.popleft().result())
            except BaseException as e:
                # The dispatch thread stops first (a call it has begun ends, queued ones are dropped): then no key is
                # settled under us. Claims still pending are given up (whoever waits on them must not wait forever);
                # a key this call settled, which another caller may have claimed again since, is left to that caller.
                # The wait can take seconds: a second Ctrl-C there must not leave the claims pending forever.
                try:
                    dispatcher.shutdown(wait=True, cancel_futures=True)
                finally:
                    for key, claim in claimed.items():
                        self.cache.abandon(key, RuntimeError(f"the encode computing this image failed: {e!r}"), claim)
                raise
            keys = [None if isinstance(e, ImageInputError) else (self.model_id, *pipe.cache_key(e)) for e in outcome]
        results: list[Encoded | ImageInputError] = []
        for (name, _), entry, key in zip(items, outcome, keys, strict=True):
            value = entry if key is None else _settled(found[key])
            if isinstance(value, RuntimeError):  # that other call's failure: raised, or this input's error
                if settings.errors == "raise":
                    raise value
                value = ImageInputError(name, str(value))
            if isinstance(value, ImageInputError):
                value = value if value.name == name else type(value)(name, value.reason)  # a video's stays one
                if settings.errors == "raise":
                    raise value
                results.append(value)
            else:
                grid, features = value
                results.append(Encoded(name, grid, entry.digest, features, self.cfg.out_hidden_size, entry.decoder))
        return results

    def resolve_decoder(self, decoder: str = "auto") -> str:
        """The backend `encode(..., decoder=...)` uses: "pil" (HF-exact, on the CPU) or "dali" (NVIDIA DALI).

        "auto" is "dali" when DALI is installed and the encoder's (first) device is a GPU, else "pil"; "dali"
        runs DALI's CPU backend where there is no GPU, and refuses when DALI is not installed.
        """
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, not {decoder!r}")
        on_gpu = self.parallel.engines[0].devices[0].platform == "gpu"
        if decoder == "auto":
            return "dali" if on_gpu and dali.available() else "pil"
        if decoder == "dali" and not dali.available():
            raise ValueError("decoder='dali' needs NVIDIA DALI: pip install 'vitjax[dali]' (or vitjax[dali-cuda12])")
        return decoder

    def _dali_rows(self) -> dali.DaliRows:
        """DALI on the encoder's first device (its pipeline is kept between calls)."""
        with self._dali_lock:
            if self._dali is None:
                self._dali = dali.DaliRows(self.cfg, self.parallel.engines[0].devices[0])
            return self._dali

    def _dispatch(
        self, pipe: Pipeline, batch: Batch, found: dict, dispatcher: ThreadPoolExecutor, in_flight: deque
    ) -> None:
        """The batch's call, given to the dispatch thread (`_call`). With two calls in flight, the older one is waited
        for first (its error raised here), so queued calls cannot pile up host buffers or device work."""
        if len(in_flight) >= 2:
            jax.block_until_ready(in_flight.popleft().result())
        in_flight.append(dispatcher.submit(self._call, pipe, batch, found))

    def _call(self, pipe: Pipeline, batch: Batch, found: dict) -> list[jax.Array]:
        """One `encode_patches` on the batch's rows once they are filled (asynchronous where the call's program
        allows); its results go to `found` (keys the caller put there) and the cache."""
        pixels, failed = batch.finish()
        levels = pixels.dtype == LEVELS  # host rows (DALI's are float32 values)
        outs = self.encode_patches(pixels, np.array([item.grid for item in batch.items]), levels=levels)
        self.images_encoded += len(batch.items)
        for item, error, out in zip(batch.items, failed, outs, strict=True):
            key = (self.model_id, *pipe.cache_key(item))
            if error is not None:
                found[key] = error
                self.cache.abandon(key, error)
            else:
                found[key] = (item.grid, out)
                # `out` views the call's whole output: what the cache stores is a copy (made without a compile),
                # so what it holds is what it counts; a value it will not store (cache off) is not copied.
                stored = out.nbytes <= self.cache.max_bytes
                kept = jax.device_put(out, out.sharding, may_alias=False) if stored else out
                self.cache.put(key, (item.grid, kept))
        return outs


def _check_settings(cfg: VisionConfig, dtype: jnp.dtype, kw: dict) -> list[jax.Device]:
    """Refuse an encoder's settings (`Encoder.__init__`'s keywords) before any weight is read, drawn or copied: the
    attention path against the dtype, the devices and their sequence-parallel groups, the buckets against those.
    Returns the devices picked."""
    settings = list(inspect.signature(Encoder.__init__).parameters)[3:]  # after self, cfg and model
    if unknown := sorted(set(kw) - set(settings)):
        raise TypeError(f"unknown Encoder setting(s) {', '.join(unknown)}; the settings are {', '.join(settings)}")
    named = named_implementation(kw.get("attention"), dtype)
    check_max_bytes(kw.get("cache_bytes", 0))
    policy = kw.get("buckets") or BucketPolicy()
    if not isinstance(policy, BucketPolicy):
        raise ValueError(f"buckets must be a vitjax.buckets.BucketPolicy, got {policy!r}")
    picked = pick_devices(kw.get("devices"))
    check_devices(named, picked, "attention" if kw.get("attention") else f"${ENV_VAR}")
    groups = device_groups(picked, kw.get("sequence_parallel", 1), cfg.num_heads)
    policy.check_group(len(groups[0]))
    return picked


def _settled(value: object) -> object:
    """A value found for a digest; a `Future` (another thread encoded it) is waited for, its error returned."""
    if not isinstance(value, Future):
        return value
    try:
        return value.result()
    except ImageInputError as e:
        return e
    except RuntimeError as e:  # the call encoding it failed for its own reason (out of memory, interrupted)
        return e
