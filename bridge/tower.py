"""`JaxVisionTower`: SGLang's vision-tower contract over a `vitjax.Encoder`.

SGLang's Qwen3-VL model reads `device`, `dtype`, `spatial_merge_size`, `out_hidden_size`,
`deepstack_visual_indexes` and `use_data_parallel` from its tower and calls it as
`tower(pixel_values [N, 1536], grid_thw [n, 3])` -> `[N/4, out_hidden * (1 + deepstack)]`, columns
`[merger | deepstack_0 | ...]` (reference/sglang-integration.md §1.2, §9.2). Pixels and features cross
between torch and JAX through DLPack; all tower logic is vitjax's.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Sequence

import jax
import numpy as np
import torch
from torch import nn

import vitjax
from bridge import backend, dlpack
from vitjax.buckets import Bucket
from vitjax.notices import notice_once
from vitjax.weights import from_named_arrays


def torch_device(device: jax.Device) -> torch.device:
    """The torch device of a JAX device (a GPU by its index on this host)."""
    return torch.device("cuda", device.local_hardware_id) if device.platform == "gpu" else torch.device("cpu")


def jax_device(device: torch.device) -> jax.Device:
    """The JAX device for a torch device. In a process that has not started JAX yet, `cuda:0` is made the only
    GPU JAX opens (otherwise XLA would claim memory on every visible GPU)."""
    if device.type != "cuda":
        return jax.devices("cpu")[0]
    index = torch.cuda.current_device() if device.index is None else device.index
    if not jax._src.xla_bridge.backends_are_initialized():  # noqa: SLF001 (checked on JAX 0.10.2 and 0.11.2)
        _open_gpus(index)
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:  # a CPU-only JAX, or a CUDA plugin that cannot start
        hint = "JAX's CUDA build: vitjax[cuda13] or vitjax[cuda12]"
        raise RuntimeError(f"the JAX tower on {device} finds no GPU in JAX (it needs {hint}): {e}") from e
    found = [d for d in gpus if d.local_hardware_id == index]
    if not found:
        raise RuntimeError(f"torch device {device} has no JAX counterpart among {gpus}")
    return found[0]


def _open_gpus(index: int) -> None:
    """Which GPUs JAX opens for a tower on GPU `index`. JAX 0.11.2 cannot use a GPU other than the first that
    `jax_cuda_visible_devices` leaves it (every transfer fails: "Device id 1 is out of range [0, 1)"; 2 x H100,
    2026-11-25), so a tower on GPU 1 or later opens them all, which costs each other GPU a context (~550 MiB)
    and must not preallocate on every one of them."""
    if index == 0:
        jax.config.update("jax_cuda_visible_devices", "0")
        return
    if backend.preallocates():
        raise RuntimeError(
            f"a JAX tower on cuda:{index} opens every GPU (JAX {jax.__version__}), so XLA_PYTHON_CLIENT_PREALLOCATE "
            "must be false: preallocation would take memory on each of them"
        )


class JaxVisionTower(nn.Module):
    """SGLang's Qwen3-VL vision tower, computed by a `vitjax.Encoder` (on the encoder's first device).

    `pixel_values` may live on any device (host, GPU, or a CUDA-IPC tensor SGLang has opened); they are read
    through DLPack where they are and moved to the encoder's device only if elsewhere. The output is one
    tensor on `device` in the encoder's dtype that owns its memory. The tower holds one empty
    torch parameter, so `device`, `dtype` and `next(model.parameters())` work as on SGLang's own tower.
    Built without an encoder (inside SGLang, before its weights are read), it takes one with `load`.
    """

    def __init__(
        self,
        encoder: vitjax.Encoder | None = None,
        *,
        config: vitjax.VisionConfig | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        use_data_parallel: bool = False,
    ):
        super().__init__()
        if encoder is None and (config is None or device is None or dtype is None):
            raise ValueError("JaxVisionTower needs an encoder, or a config, device and dtype to load one into")
        config = encoder.cfg if encoder is not None else config
        if encoder is not None:
            device = device or torch_device(encoder.parallel.engines[0].devices[0])
            dtype = dtype or getattr(torch, encoder.dtype.name)
        self._anchor = nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False)
        # Found now, when SGLang builds the model: a JAX without its CUDA plugin fails here, not after the checkpoint.
        self._jax_device = encoder.parallel.engines[0].devices[0] if encoder is not None else jax_device(self.device)
        self.config = config
        self.encoder = encoder
        self.spatial_merge_size = config.spatial_merge_size
        self.out_hidden_size = config.output_width
        self.hidden_size = config.hidden_size
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        self.use_data_parallel = use_data_parallel
        self.calls = 0  # tower calls (each image or video of a call counted in `items`)
        self.items = 0

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self._anchor.dtype

    def load(self, tensors: Iterable[tuple[str, np.ndarray]], where: str, model_id: str | None = None, **kw) -> None:
        """Build the encoder from (HF name, array) pairs (vitjax's strict checks), on this tower's device. Once
        built, a load is an update (SGLang's weight updates): the tensors given replace theirs in place."""
        with self._on_device():
            if self.encoder is not None:
                self.encoder.set_params(from_named_arrays(tensors, self.config, where, base=self.encoder.params()))
                return
            params = from_named_arrays(tensors, self.config, where)
            self.encoder = vitjax.Encoder.from_params(
                self.config, params, self._dtype_name(), model_id=model_id or where, **self._serving(kw)
            )

    def load_random(self, seed: int = 0, **kw) -> None:
        """Random weights, where SGLang reads no checkpoint (`--load-format dummy`: it fills its own parameters
        with random values too)."""
        with self._on_device():
            self.encoder = vitjax.Encoder.random(self.config, seed, self._dtype_name(), **self._serving(kw))

    def _dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def _serving(self, kw: dict) -> dict:
        """Encoder settings for serving inside SGLang, unless given."""
        kw.setdefault("devices", [self._jax_device])
        kw.setdefault("cache_bytes", 0)  # SGLang keeps its own per-image cache
        kw.setdefault("buckets", backend.bucket_policy())
        return kw

    def warmup(self, buckets: Sequence[Bucket] | None = None) -> None:
        """Compile (or load from the persistent cache) the executables the served pixel rows will use."""
        with self._on_device():
            self._ready().warmup(buckets, pixel_dtype=self._dtype_name())

    def warmup_for_serving(self) -> None:
        """The warm-up `VITJAX_WARMUP` asks for: "all" buckets (default), "none", or token sizes "512,4096"."""
        self.warmup(backend.warmup_buckets(self._ready().parallel.engines[0].policy))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        with self._on_device():
            encoder = self._ready()
            grid = np.asarray(grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw)
            grid = grid if grid.size else np.zeros((0, 3), np.int64)  # a call without items; the rest is checked below
            pixel_values = pixel_values.to(self.dtype)
            # Rows already on the tower's kind of device are read in place; host rows for a GPU tower go the
            # host path (chunks copied up), not through a CPU JAX array sliced by ops compiled per row count.
            on_device = pixel_values.device.type == self.device.type
            pixels = dlpack.to_jax(pixel_values) if on_device else dlpack.to_numpy(pixel_values)
            start = time.perf_counter()
            outs = encoder.encode_patches(pixels, grid)  # checks grid and row count first, names what is wrong
            if not outs:
                self.calls += 1
                return torch.empty((0, self.out_hidden_size), device=self.device, dtype=self.dtype)
            # Each output views its call's padded output. The features are copied into one tensor of their own
            # rows, by torch (a JAX concatenation compiles once per combination of sizes): SGLang's cache sees a
            # tensor's own bytes only, so a view would keep the whole padded output alive uncounted. An encoder
            # on several devices leaves each image's features where it ran: they are gathered on the tower's.
            parts = [dlpack.to_torch(out).to(self.device) for out in outs]
            features = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
            self.calls += 1  # once the features exist: a call that failed on the way (out of memory) is not counted
            self.items += len(outs)
            if trace := os.environ.get(backend.TRACE_ENV):
                record = {"pid": os.getpid(), "grid_thw": grid.tolist(), "seconds": time.perf_counter() - start}
                try:
                    with open(trace, "a") as f:
                        f.write(json.dumps(record) + "\n")
                except OSError as e:  # a full disk or a removed folder costs the trace, never the request
                    notice_once(__name__, f"{backend.TRACE_ENV}={trace!r}: not written ({e.strerror or e})")
            return features

    def _on_device(self) -> contextlib.AbstractContextManager:
        """torch's current CUDA device set to the tower's around JAX work and given back after: JAX may leave the CUDA
        runtime on another GPU (a tower on cuda:1 found torch on cuda:0 after loading; 2 x H100, JAX 0.11.2), and
        torch reads it (DLPack export, and SGLang's own work after the tower)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _ready(self) -> vitjax.Encoder:
        if self.encoder is None:
            raise RuntimeError("JaxVisionTower has no weights yet: call load() first")
        return self.encoder

    def extra_repr(self) -> str:
        return f"vitjax, {self.config.depth} blocks, device={self.device}, dtype={self.dtype}"
