"""Vision-tower configuration: presets for the released Qwen3-VL models and HF config.json parsing."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from vitjax.checks import is_int, is_positive

# Model types whose config.json carries a Qwen3-VL vision tower.
_QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_vl_vision", "qwen3_vl_moe_vision")
# Fields without which the architecture is undefined: no silent HF defaults for these.
_REQUIRED = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "deepstack_visual_indexes")
# Every field but these is a count or a size: a positive integer (a string, a float or 0 would fail deep inside).
_NOT_COUNTS = ("deepstack_visual_indexes", "hidden_act", "rope_theta")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The Qwen3-VL vision tower's shape; field names follow HF's `Qwen3VLVisionConfig`."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    deepstack_visual_indexes: tuple[int, ...]
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in _NOT_COUNTS and not (is_int(value) and value >= 1):
                raise ValueError(f"{field.name} must be a positive integer, got {value!r}")
        taps = self.deepstack_visual_indexes
        if not isinstance(taps, (list, tuple)) or not all(is_int(i) for i in taps):
            raise ValueError(f"deepstack_visual_indexes must be a list of block numbers, got {taps!r}")
        object.__setattr__(self, "deepstack_visual_indexes", tuple(int(i) for i in self.deepstack_visual_indexes))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of 4 for the 2-D rotary embedding")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a square number")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} are outside the {self.depth} blocks")
        if list(self.deepstack_visual_indexes) != sorted(set(self.deepstack_visual_indexes)):
            # HF orders the deepstack features by block, but numbers their mergers by position in this list.
            raise ValueError(f"deepstack_visual_indexes {list(self.deepstack_visual_indexes)} must be ascending")
        if self.spatial_merge_size != 2:  # the buckets hold whole 2x2 merge groups
            raise ValueError(f"spatial_merge_size {self.spatial_merge_size} is not supported (Qwen3-VL merges 2x2)")
        if self.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Qwen3-VL uses 'gelu_pytorch_tanh')")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one pixel row: channels x temporal x patch x patch (1536)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per output token (4)."""
        return self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """Side of the learned square position-embedding table (48)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def output_width(self) -> int:
        """Columns of the per-image output: merger plus each deepstack merger."""
        return self.out_hidden_size * (1 + len(self.deepstack_visual_indexes))

    @classmethod
    def preset(cls, name: str) -> VisionConfig:
        """One of the released models: qwen3-vl-{2b,4b,8b,32b,30b-a3b,235b-a22b}."""
        return PRESETS[cls.preset_name(name)]

    @staticmethod
    def preset_name(name: str) -> str:
        """`name` as PRESETS spells it (`8B`, `Qwen/Qwen3-VL-8B` -> `qwen3-vl-8b`); a ValueError if none."""
        key = name.lower().removeprefix("qwen/").replace("_", "-")
        key = key if key.startswith("qwen3-vl-") else f"qwen3-vl-{key}"
        if key not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return key

    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any]) -> VisionConfig:
        """Read a full-model config.json (`vision_config` inside) or a vision-only one (path, dir or dict).
        Every error is a ValueError (a FileNotFoundError for no file) naming the file or the dict."""
        if isinstance(source, dict):
            raw, where = source, "config dict"
        else:
            path = Path(source)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise FileNotFoundError(f"no config.json at {path}")
            try:
                raw = json.loads(path.read_bytes())
            except ValueError as e:  # JSON and UTF-8 errors alike: say which file they are in
                raise ValueError(f"{path}: not a JSON config ({e})") from None
            where = str(path)
        try:
            return cls._from_dict(raw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def _from_dict(cls, raw: object) -> VisionConfig:
        if not isinstance(raw, dict):
            raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type is not None and model_type not in _QWEN3_VL_TYPES:
            known = ", ".join(_QWEN3_VL_TYPES)
            raise ValueError(f"model_type {model_type!r} is not a Qwen3-VL model ({known})")
        vision = raw.get("vision_config", raw)
        if not isinstance(vision, dict):
            raise ValueError(f"vision_config must be a JSON object, got {type(vision).__name__}")
        missing = [k for k in _REQUIRED if k not in vision]
        if missing:
            raise ValueError(f"vision config lacks {missing}")
        rope_key = "rope_parameters" if vision.get("rope_parameters") else "rope_scaling"
        rope = vision.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{rope_key} must be a JSON object, got {rope!r}")
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported (Qwen3-VL uses 'axial')")
        theta = rope.get("rope_theta", vision.get("rope_theta", 10000.0))
        if not is_positive(theta):
            raise ValueError(f"rope_theta must be a positive number, got {theta!r}")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        return cls(**{k: vision[k] for k in names if k in vision}, rope_theta=float(theta))

    def to_hf(self) -> dict[str, Any]:
        """A vision-only config.json that `from_hf` (and HF's `Qwen3VLVisionConfig`) reads back."""
        out = dataclasses.asdict(self)
        out["deepstack_visual_indexes"] = list(self.deepstack_visual_indexes)
        out["rope_parameters"] = {"rope_type": "axial", "rope_theta": out.pop("rope_theta")}
        out["model_type"] = "qwen3_vl_vision"
        return out


def _preset(depth: int, hidden: int, inter: int, out: int, taps: tuple[int, ...]) -> VisionConfig:
    return VisionConfig(depth, hidden, 16, inter, out, taps)


PRESETS: dict[str, VisionConfig] = {
    "qwen3-vl-2b": _preset(24, 1024, 4096, 2048, (5, 11, 17)),
    "qwen3-vl-4b": _preset(24, 1024, 4096, 2560, (5, 11, 17)),
    "qwen3-vl-8b": _preset(27, 1152, 4304, 4096, (8, 16, 24)),
    "qwen3-vl-32b": _preset(27, 1152, 4304, 5120, (8, 16, 24)),
    "qwen3-vl-30b-a3b": _preset(27, 1152, 4304, 2048, (8, 16, 24)),
    "qwen3-vl-235b-a22b": _preset(27, 1152, 4304, 4096, (8, 16, 24)),
}
