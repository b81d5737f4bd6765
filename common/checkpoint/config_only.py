"""Config-only Ming checkpoints: the real root `config.json` of a thinker shape plus the tiny tokenizer.

No weights: a thinker started from one needs `model.load_format: dummy` (random weights in the real
shapes and dtype, made on the device). So `omnistage make-config-checkpoint --shape ming-flash DIR`
lets `omnistage serve` run the full Ming-flash-omni-2.0 thinker (ming.md §2.1) without the
200 GB download. Token ids come from the tiny tokenizer (they are read from the files, never
assumed), so text is noise, the shapes and the memory are the release's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnistage.common.checkpoint.tiny import TINY_LLM
from omnistage.common.checkpoint.tiny_tokenizer import write_tiny_tokenizer

# The full Ming-flash-omni-2.0 thinker (ming.md §2.1): ~103 B parameters, 256 experts.
MING_FLASH: dict[str, Any] = dict(
    vocab_size=157184, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, intermediate_size=9216, first_k_dense_replace=1, num_experts=256, num_experts_per_tok=8,
    num_shared_experts=1, moe_intermediate_size=1024, n_group=8, topk_group=4,
)  # fmt: skip
# Ling-mini-2.0's size with Ming's thinker features (16.3 B parameters).
LING_MINI: dict[str, Any] = dict(
    vocab_size=157184, hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4,
    head_dim=128, intermediate_size=5120, first_k_dense_replace=1, num_experts=256, num_experts_per_tok=8,
    num_shared_experts=1, moe_intermediate_size=512, n_group=8, topk_group=4,
)  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "ming-flash": MING_FLASH,
    "ling-mini": LING_MINI,
    "tiny": {"vocab_size": 0, **TINY_LLM},  # vocab 0: just large enough for the tokenizer
}


def llm_config(shape: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    """The release's `llm_config` keys (ming.md §2.1) for `shape`, special ids from the tokenizer."""
    vocab = shape.get("vocab_size") or -(-(max(ids.values()) + 1) // 64) * 64
    if vocab <= max(ids.values()):
        raise ValueError(f"vocab_size {vocab} does not hold the tokenizer's ids (largest {max(ids.values())})")
    return {
        "architectures": ["BailingMoeV2ForCausalLM"],
        "model_type": "bailing_moe_v2",
        **shape,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_bias": False,
        "rope_theta": 2400000,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "video_rope", "factor": None},
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "moe_router_topk_scaling_factor": 2.5,
        "score_function": "sigmoid",
        "use_expert_bias": True,
        "norm_topk_prob": True,
        "router_type": "MultiRouter",
        "eos_token_id": ids["<|role_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "image_patch_token": ids["<imagePatch>"],
        "video_patch_token": ids["<framePatch>"],
        "image_start_token": ids["<image>"],
        "torch_dtype": "bfloat16",
    }


def write_config_checkpoint(out_dir: str | Path, shape: str | dict[str, Any] = "ming-flash") -> Path:
    """Write config.json (thinker `llm_config` of `shape`: a name of SHAPES or a dict) and the tiny
    tokenizer into `out_dir`; no weight files (serve it with `model.load_format: dummy`)."""
    dims = SHAPES[shape] if isinstance(shape, str) else shape
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tiny_tokenizer(out)
    config = {
        "architectures": ["BailingMM2NativeForConditionalGeneration"],
        "model_type": "bailingmm_moe_v2_lite",
        "llm_config": llm_config(dims, ids),
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"do_sample": False, "eos_token_id": [ids["<|role_end|>"]], "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out

