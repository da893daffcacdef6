"""Runs one real SGLang `Engine` on the CPU in its own process and records what it generated.

`python tests/sglang_driver.py SPEC.json OUT.json`: SPEC gives the backend ("torch": SGLang's own tower,
"jax": the bridge, configured exactly as `bridge.launch_server` configures it), the model, Engine
arguments and the requests, sent one at a time (an `update_weights` entry instead updates those tensors to
their saved values times its `scale`, default 1; a `save_sharded` entry saves the model's torch parameters
there, as SGLang's `save_sharded_model` does). OUT gets, per request, the greedy output tokens with their
log-probabilities and top alternatives, or the error (per update, what SGLang answered). A process of its own
per Engine, because SGLang reads its hooks from the environment at spawn time and kills its process tree on
fatal errors.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

STUBS = Path(__file__).parent / "stubs"


def engine_arguments(model: str, **extra) -> dict:
    """A tiny model on the CPU: SGLang's torch-native attention, fp32, prefill in chunks of 32 tokens."""
    return {
        "model_path": model,
        "device": "cpu",
        "attention_backend": "torch_native",
        "mm_attention_backend": "sdpa",
        "disable_cuda_graph": True,
        "dtype": "float32",
        "chunked_prefill_size": 32,
        "max_total_tokens": 4096,
        "log_level": "warning",
        **extra,
    }


def pin_memory_without_a_gpu() -> None:
    """SGLang's video preprocessing pins each decoded clip in host memory unless SGLANG_USE_CPU_ENGINE is set
    (`multimodal/processors/qwen_vl.py`, 0.5.23), and pinning needs an NVIDIA driver; that setting needs a CPU
    build of sgl-kernel that PyPI does not have. Without a GPU, pinned memory is plain memory."""
    import torch

    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def main(spec_file: str, out_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    os.environ["PYTHONPATH"] = os.pathsep.join([str(STUBS), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(STUBS))
    from bridge import backend

    backend.configure(spec["backend"])
    pin_memory_without_a_gpu()
    import sglang as sgl
    import torch

    engine = sgl.Engine(**engine_arguments(spec["model"], **spec.get("engine", {})))
    results = []
    try:
        for request in spec["requests"]:
            if "update_weights" in request:  # the checkpoint's own values of these tensors, as a weight update
                from safetensors.torch import load_file

                saved = {k: v for f in Path(spec["model"]).glob("*.safetensors") for k, v in load_file(f).items()}
                scale = request.get("scale", 1.0)
                renamed = request.get("as", {})  # checkpoint name -> the name the update sends it under
                named = [(renamed.get(name, name), saved[name] * scale) for name in request["update_weights"]]
                named += [(sent, saved[name] * scale) for sent, name in request.get("also", [])]  # (sent as, tensor)
                steps = [
                    engine.begin_weight_update(),
                    engine.update_weights_from_tensor(named),
                    engine.end_weight_update(),
                ]
                results.append({"update": [list(step) for step in steps]})
                continue
            if "save_sharded" in request:  # the model's torch parameters, for `--load-format sharded_state`
                engine.save_sharded_model(path=request["save_sharded"], pattern=None, max_size=None)
                results.append({"saved": request["save_sharded"]})
                continue
            images = request.get("images") or None
            if "processor_output" in request:  # pixel rows as given, bypassing SGLang's image processor
                rows, grid = request["processor_output"]  # grid None: none given
                pixels = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(0))
                item = {"format": "processor_output", "pixel_values": pixels}
                images = [item if grid is None else {**item, "image_grid_thw": torch.tensor([grid])}]
            try:
                out = engine.generate(
                    prompt=request["prompt"],
                    image_data=images,
                    video_data=request.get("videos") or None,
                    sampling_params={"max_new_tokens": request.get("max_new_tokens", 4), "temperature": 0},
                    return_logprob=True,
                    top_logprobs_num=3,
                )
                meta = out["meta_info"]
                results.append(
                    {
                        "tokens": [t[1] for t in meta["output_token_logprobs"]],
                        "logprobs": [t[0] for t in meta["output_token_logprobs"]],
                        "top": [[[a[0], a[1]] for a in step] for step in meta["output_top_logprobs"]],
                        "prompt_tokens": meta["prompt_tokens"],
                    }
                )
            except Exception as e:  # a request SGLang refused: recorded, and the engine goes on
                results.append({"error": f"{type(e).__name__}: {e}"})
    finally:
        engine.shutdown()
    Path(out_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
