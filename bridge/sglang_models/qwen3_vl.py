"""SGLang's Qwen3-VL classes (dense and MoE) with the vision tower computed by vitjax.

The classes keep SGLang's names and everything of SGLang's classes except `self.visual`: with
`VITJAX_MM_ENCODER_BACKEND=jax` the constructor builds a `JaxVisionTower` where SGLang would build its
torch tower, `load_weights` hands the `model.visual.*` tensors of SGLang's own weight iterator to it,
and the bucket executables are compiled in SGLang's post-load hook, before the KV cache is sized. With
any other backend they are SGLang's classes unchanged. SGLang's feature calls, per-image cache,
chunk-aware encoding, DP encoder and encoder server all stay SGLang's.

Checked against sglang 0.5.23 (the module global `Qwen3VLMoeVisionModel` that the constructor calls, the
constructor's keyword names, the `precompile_kernels_after_loading` hook, the vision tensor names its
`load_weights` takes, and where the load format is read).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
from sglang.srt.models import qwen3_vl, qwen3_vl_moe

from bridge import backend

logger = logging.getLogger(__name__)
VISUAL_PREFIXES = ("model.visual.", "visual.")


def hf_visual_name(name: str) -> str:
    """A vision tensor's name as vitjax reads it (HF's, under `visual.`), from any name SGLang's own `load_weights`
    takes for its tower: the checkpoint's `model.visual.` or SGLang's `visual.`, and SGLang's `attn.qkv_proj.` for
    HF's `attn.qkv.` (weight updates may carry SGLang's parameter names, or both prefixes in one update)."""
    return name.removeprefix("model.").replace(".attn.qkv_proj.", ".attn.qkv.")


def sglang_load_format() -> str:
    """The `--load-format` SGLang loads this model with (its runtime context's model settings, which a draft
    model's loading overrides with its own; checked on sglang 0.5.23)."""
    from sglang.srt.runtime_context import get_model

    load_format = get_model().load_format
    return str(getattr(load_format, "value", load_format))


@contextlib.contextmanager
def _jax_tower_in_place_of_sglangs():
    """While SGLang's constructor runs, its tower class builds a weightless `JaxVisionTower` instead
    (same keywords: vision_config, norm_eps, quant_config, prefix, use_data_parallel)."""
    from bridge.tower import JaxVisionTower
    from vitjax.config import VisionConfig

    def build(vision_config, norm_eps=1e-6, quant_config=None, prefix="", use_data_parallel=False):
        return JaxVisionTower(
            config=VisionConfig.from_hf(vision_config.to_dict()),
            device=torch.empty(0).device,  # SGLang builds the model under its target device and dtype
            dtype=torch.get_default_dtype(),
            use_data_parallel=use_data_parallel,
        )

    original = qwen3_vl.Qwen3VLMoeVisionModel
    qwen3_vl.Qwen3VLMoeVisionModel = build
    try:
        yield
    finally:
        qwen3_vl.Qwen3VLMoeVisionModel = original


class _VitjaxTower:
    """The swap, shared by the dense and MoE classes (placed before SGLang's class in the MRO)."""

    def __init__(self, config, *args, **kwargs):
        if backend.current() != "jax":
            super().__init__(config, *args, **kwargs)
            return
        with _jax_tower_in_place_of_sglangs():
            super().__init__(config, *args, **kwargs)
        if self.visual is not None and not self._vitjax():  # SGLang built its tower some other way than checked
            import sglang

            raise RuntimeError(
                f"vitjax: SGLang {sglang.__version__} built its own vision tower where the bridge puts the JAX one "
                "(checked on sglang 0.5.23); serve with SGLang 0.5.23, or with --mm-encoder-backend torch"
            )
        self._vitjax_model_id = getattr(config, "_name_or_path", "") or "sglang"
        if self.visual is not None:
            logger.info("vitjax: the vision tower runs in JAX (%s)", self.visual.extra_repr())

    def _vitjax(self) -> bool:
        from bridge.tower import JaxVisionTower

        return isinstance(getattr(self, "visual", None), JaxVisionTower)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        if not self._vitjax():
            return super().load_weights(weights)
        from bridge.dlpack import to_numpy

        visual: list[tuple[str, object]] = []

        def language(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in pairs:
                if name.startswith(VISUAL_PREFIXES):  # kept past its yield: copied, since a loader may reuse its
                    # memory for the next tensor (--load-format runai_streamer does; SGLang 0.5.23 copies there too)
                    visual.append((hf_visual_name(name), to_numpy(tensor).copy()))
                else:
                    yield name, tensor

        result = super().load_weights(language(weights))
        if visual or self.visual.encoder is None:  # SGLang's weight updates may carry the language model only
            what = "a weight update of " if self.visual.encoder is not None else ""
            where = f"{what}{self._vitjax_model_id} (SGLang's weight iterator)"
            self.visual.load(visual, where=where, model_id=self._vitjax_model_id)
        return result

    def precompile_kernels_after_loading(self) -> None:
        parent = getattr(super(), "precompile_kernels_after_loading", None)
        if parent is not None:
            parent()
        if self._vitjax():
            if self.visual.encoder is None:  # SGLang filled its parameters without calling `load_weights`
                load_format = sglang_load_format()
                if load_format != "dummy":
                    raise RuntimeError(
                        f"vitjax: --load-format {load_format} gave SGLang's parameters their values without the "
                        "model's load_weights, so the JAX vision tower, which holds its weights outside torch, read "
                        "none; serve with a format that reads the checkpoint's tensors (auto, safetensors, pt) or "
                        "with --mm-encoder-backend torch"
                    )
                logger.info("vitjax: --load-format dummy: the vision tower gets random weights, as SGLang's did")
                self.visual.load_random()
            self.visual.warmup_for_serving()


class Qwen3VLForConditionalGeneration(_VitjaxTower, qwen3_vl.Qwen3VLForConditionalGeneration):
    pass


class Qwen3VLMoeForConditionalGeneration(_VitjaxTower, qwen3_vl_moe.Qwen3VLMoeForConditionalGeneration):
    pass


EntryClass = [Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration]
