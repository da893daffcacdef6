"""A tiny, complete Qwen3-VL checkpoint that SGLang can serve, built locally: config and random weights
(transformers' `save_pretrained`), a byte-level BPE tokenizer with Qwen's special tokens and chat
template, and HF's image and video processors with Qwen3-VL's settings (nothing from a hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import hf_vision_config, randomize
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

import vitjax

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
VOCAB = 320
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Small images (min 4x4 patches of 16 px, max 16x16): a few dozen image tokens each.
MIN_PIXELS, MAX_PIXELS = 64 * 64, 256 * 256


def tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE over the 256 byte symbols (no merges), then Qwen's special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL[1:]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def released_expert_layout(file: Path) -> None:
    """transformers 5 saves fused MoE experts as [experts, out, in]; the released Qwen3-VL-MoE checkpoints
    (what SGLang's loader reads, transposing them itself) hold [experts, in, out]."""
    tensors = load_file(file)
    for key in tensors:
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[key] = tensors[key].transpose(-1, -2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


def build(path: Path, cfg: vitjax.VisionConfig, moe: bool = False, seed: int = 0) -> Path:
    """Write a servable checkpoint to `path` (text hidden = cfg.out_hidden_size, 2 layers)."""
    tok = tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    text = {
        "hidden_size": cfg.out_hidden_size,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        "eos_token_id": ids["<|im_end|>"],
        "tie_word_embeddings": False,
    }
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    config_cls, model_cls = (
        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
        if moe
        else (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    )
    config = config_cls(
        vision_config=hf_vision_config(cfg).to_dict(),
        text_config=text,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_cls._from_config(config, dtype=torch.float32).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    if moe:
        released_expert_layout(Path(path) / "model.safetensors")
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            patch_size=16,
            merge_size=2,
            temporal_patch_size=2,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
            size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        ),
        video_processor=Qwen3VLVideoProcessor(
            size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS * 4},
            min_frames=2,
            max_frames=8,
        ),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    config_file = Path(path) / "config.json"
    saved = json.loads(config_file.read_text())
    assert saved["architectures"] == [model_cls.__name__], saved["architectures"]
    return Path(path)
