"""SGLang's Qwen-VL processor, plus a check of every item before it reaches the scheduler.

In SGLang 0.5.23 an error inside the scheduler's forward (a tower call with pixel rows that do not fit
their grid, or embeddings that do not fit the prompt's placeholders) takes the whole server down. Here,
in the tokenizer process, the same mismatch is an error for its own request: the grid must be valid, the
pixel rows exactly t*h*w, and the placeholder span exactly t*h*w/4 tokens (vitjax's own check). The
hook is `_postprocess_mm_items_before_transport`, where every path (images SGLang processed, `processor_output`
rows) has its per-image items with offsets, and features are still tensors: after it, SGLang may wrap them as
CUDA-IPC handles, which have no shape (checked on sglang 0.5.23, as the items' fields it reads).
"""

from __future__ import annotations

from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor as _SGLangProcessor

from bridge.sglang_models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration
from vitjax.layout import check_patches


def check_items(items: list, patch_dim: int, merge: int) -> None:
    """Raise ValueError naming the first image or video item whose pixel rows, grid or placeholder span do not fit."""
    for i, item in enumerate(items):
        modality = item.modality.name.lower()
        shape = getattr(item.feature, "shape", None)
        if modality not in ("image", "video") or shape is None or item.precomputed_embeddings is not None:
            continue  # no pixel rows: audio, or embeddings computed elsewhere (SGLang's encoder server)
        where = f"{modality} {i}"
        grid = item.model_specific_data.get(f"{modality}_grid_thw")
        if grid is None:  # SGLang would find none when the tower is called, in the scheduler
            raise ValueError(f"{where}: pixel rows without {modality}_grid_thw")
        try:
            grids = check_patches(tuple(shape), grid.tolist() if hasattr(grid, "tolist") else grid, patch_dim, merge)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        tokens = sum(t * h * w for t, h, w in grids) // merge**2
        span = sum(end - start + 1 for start, end in item.offsets or [])
        if span != tokens:
            raise ValueError(f"{where}: the prompt has {span} placeholder tokens for it, but its grid {grids} makes "
                             f"{tokens}")  # fmt: skip


class QwenVLImageProcessor(_SGLangProcessor):
    models = [Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration]

    def _postprocess_mm_items_before_transport(self, mm_items, **kwargs):
        mm_items = super()._postprocess_mm_items_before_transport(mm_items, **kwargs)
        vision = self.hf_config.vision_config
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        check_items(mm_items, patch_dim, vision.spatial_merge_size)
        return mm_items
