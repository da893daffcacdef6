"""The user-facing Encoder: weights on device plus one jit-compiled pure forward function."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vitjax import layout, weights
from vitjax.attention import Segments, default_implementation
from vitjax.config import VisionConfig
from vitjax.model import TowerInputs, VisionTower


def abstract_tower(cfg: VisionConfig, dtype: jnp.dtype) -> VisionTower:
    """The tower with shapes only (no memory, no compute): for parameter counts and weight loading."""
    return nnx.eval_shape(lambda: VisionTower(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def _forward(graph: nnx.GraphDef, state: nnx.State, pixels: jax.Array, inputs: TowerInputs, impl: str) -> jax.Array:
    return nnx.merge(graph, state)(pixels, inputs, impl)


@functools.partial(jax.jit, static_argnums=2)
def _take_rows(out: jax.Array, start: jax.Array, rows: int) -> jax.Array:
    """Rows [start, start+rows) of the output; compiled per row count, not per offset."""
    return jax.lax.dynamic_slice_in_dim(out, start, rows)


class Encoder:
    """Qwen3-VL vision tower: `encode_patches(pixel_values, grid_thw)` -> one array per image/video."""

    def __init__(self, cfg: VisionConfig, model: VisionTower, attention: str | None = None):
        self.cfg = cfg
        self.dtype = model.dtype
        self.attention = attention or default_implementation()
        self._graph, self._state = nnx.split(model)
        self._forward = jax.jit(functools.partial(_forward, self._graph), static_argnames="impl")

    @classmethod
    def from_params(cls, cfg: VisionConfig, params: weights.Params, dtype: str = "bfloat16", **kw) -> Encoder:
        """Build from a nested parameter dict (as `weights.load_hf` returns), cast to `dtype`."""
        dtype = jnp.dtype(dtype)
        model = abstract_tower(cfg, dtype)
        state = nnx.state(model)
        nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, dtype), params))
        nnx.update(model, state)
        return cls(cfg, model, **kw)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str = "bfloat16", progress: bool = False, **kw) -> Encoder:
        """Load an HF directory (config.json + *.safetensors) or a directory written by `vitjax convert`."""
        if weights.is_orbax(path):
            cfg, params = weights.load_orbax(path)
        else:
            cfg = VisionConfig.from_hf(path)
            params = weights.load_hf(path, cfg, progress=progress)
        return cls.from_params(cfg, params, dtype, **kw)

    @classmethod
    def random(cls, cfg: VisionConfig | str, seed: int = 0, dtype: str = "bfloat16", **kw) -> Encoder:
        """Random weights (smoke runs and benchmarks); `cfg` may be a preset name."""
        cfg = VisionConfig.preset(cfg) if isinstance(cfg, str) else cfg
        return cls(cfg, VisionTower(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed)), **kw)

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self._state))

    def check_inputs(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> list[layout.Grid]:
        """Validate shapes before anything reaches the device; return the grids as tuples."""
        grid = np.asarray(grid_thw)
        if grid.ndim != 2 or grid.shape[1] != 3 or not np.issubdtype(grid.dtype, np.integer):
            raise ValueError(f"grid_thw must be an integer array [n, 3], got {grid.dtype} {list(grid.shape)}")
        m = self.cfg.spatial_merge_size
        bad = [g.tolist() for g in grid if g.min() < 1 or g[1] % m or g[2] % m]
        if bad:
            raise ValueError(f"grid_thw rows {bad} must be positive with h and w divisible by {m}")
        tokens = int(grid.prod(axis=1).sum())
        if pixel_values.ndim != 2 or pixel_values.shape != (tokens, self.cfg.patch_dim):
            raise ValueError(
                f"pixel_values has shape {list(pixel_values.shape)}, but grid_thw needs [{tokens}, {self.cfg.patch_dim}]"
            )
        return [tuple(int(v) for v in g) for g in grid]

    def run_packed(self, pixel_values: jax.Array | np.ndarray, packed: layout.Packed) -> jax.Array:
        """One tower call on an already packed sequence: `[T/4, output_width]` on device."""
        inputs = TowerInputs(
            jnp.asarray(packed.pos_index),
            jnp.asarray(packed.pos_weight),
            jnp.asarray(packed.rope_pos),
            Segments(*(jnp.asarray(a) for a in (packed.segment_ids, packed.segment_starts, packed.segment_lengths))),
        )
        return self._forward(self._state, jnp.asarray(pixel_values), inputs, impl=self.attention)

    def encode_patches(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> list[jax.Array]:
        """Pixel rows (HF processor output, concatenated) -> per image/video `[t*h*w/4, output_width]`."""
        pixel_values = np.asarray(pixel_values)
        grids = self.check_inputs(pixel_values, grid_thw)
        packed = layout.pack(grids, side=self.cfg.grid_side, merge=self.cfg.spatial_merge_size)
        out = self.run_packed(pixel_values, packed)
        return [_take_rows(out, start, rows) for start, rows in layout.split_points(grids, self.cfg.merge_unit)]
