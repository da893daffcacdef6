"""vitjax behind SGLang: the tower adapter, SGLang's external model package and the launcher.

- `bridge.JaxVisionTower(encoder)`: SGLang's vision-tower contract (torch in, torch out, DLPack) over a
  `vitjax.Encoder`.
- `bridge.sglang_models`: the package SGLang loads through `SGLANG_EXTERNAL_MODEL_PACKAGE`; its
  `Qwen3VLForConditionalGeneration` and `Qwen3VLMoeForConditionalGeneration` are SGLang's own classes with
  the tower swapped.
- `python -m bridge.launch_server --mm-encoder-backend {jax,torch} <sglang.launch_server arguments>`.

Importing `bridge` imports neither torch, JAX nor SGLang (SGLang's tokenizer process imports the model
package and must not start a JAX backend); `JaxVisionTower` is loaded on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["JaxVisionTower"]


def __getattr__(name: str) -> Any:
    if name == "JaxVisionTower":
        from bridge.tower import JaxVisionTower

        return JaxVisionTower
    raise AttributeError(f"module 'bridge' has no attribute {name!r}")
