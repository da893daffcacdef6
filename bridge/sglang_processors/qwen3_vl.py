"""SGLang's Qwen-VL processor, plus a check of every item before it reaches the scheduler.

In SGLang 0.5.23 an error inside the scheduler's forward (a tower call with pixel rows that do not fit
their grid, or embeddings that do not fit the prompt's placeholders) takes the whole server down. Here,
in the tokenizer process, the same mismatch is an error for its own request: the grid must be valid, the
pixel rows exactly t*h*w, and the placeholder span exactly t*h*w/4 tokens (vitjax's own check). The
hook is `process_and_combine_mm_data_async` and the items' fields it reads (checked on sglang 0.5.23).
"""

from __future__ import annotations

from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor as _SGLangProcessor

from bridge.sglang_models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration
from vitjax.layout import check_patches


def check_items(items: list, patch_dim: int, merge: int) -> None:
    """Raise ValueError naming the first item whose pixel rows, grid or placeholder span do not fit."""
    for i, item in enumerate(items):
        grid = item.model_specific_data.get(f"{item.modality.name.lower()}_grid_thw")
        shape = getattr(item.feature, "shape", None)
        if grid is None or shape is None or item.precomputed_embeddings is not None:
            continue  # not pixel rows (precomputed embeddings, audio) or a transport handle
        where = f"{item.modality.name.lower()} {i}"
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

    async def process_and_combine_mm_data_async(self, base_output, mm_tokens, **kwargs):
        items, input_ids, ret = await super().process_and_combine_mm_data_async(base_output, mm_tokens, **kwargs)
        vision = self.hf_config.vision_config
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        check_items(items, patch_dim, vision.spatial_merge_size)
        return items, input_ids, ret
