"""Config-only Ming checkpoints: the config of every part of a shape plus the tiny tokenizers, no weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.common.checkpoint import release_shapes as release
from omnistage.common.checkpoint import tiny_imagegen, tiny_talker
from omnistage.common.checkpoint.tiny import TINY_LLM, TINY_VISION, TINY_WHISPER, llm_config, root_config
from omnistage.common.checkpoint.tiny_imagegen import write_imagegen_configs
from omnistage.common.checkpoint.tiny_talker import write_talker_files
from omnistage.common.checkpoint.tiny_tokenizer import pad_tokenizer, write_tiny_tokenizer

# The full Ming-flash-omni-2.0 thinker (ming.md §2.1): ~103 B parameters, 256 experts.
MING_FLASH: dict[str, Any] = dict(
    vocab_size=157184,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=9216,
    first_k_dense_replace=1,
    num_experts=256,
    num_experts_per_tok=8,
    num_shared_experts=1,
    moe_intermediate_size=1024,
    n_group=8,
    topk_group=4,
)
# Ling-mini-2.0's size with Ming's thinker features (16.3 B parameters): the same vocabulary, head_dim 128,
# 4 KV heads, 256 experts (8 per token, 8 groups, top 4) and one shared expert.
LING_MINI: dict[str, Any] = {
    **MING_FLASH,
    "hidden_size": 2048,
    "num_hidden_layers": 20,
    "num_attention_heads": 16,
    "intermediate_size": 5120,
    "moe_intermediate_size": 512,
}

# One rank's share of Ming-flash at TP=2 as a single-GPU model: half the query and KV heads, half of
# every MLP's intermediate (the experts', the shared expert's, layer 0's), the rest as the release.
# For benchmarks of the per-rank kernels on one card (~96 GiB of bf16 weights: it fits one H200);
# what it leaves out is TP=2's all-reduces and the vocabulary split of the embedding and LM head.
MING_FLASH_TP2_RANK: dict[str, Any] = {
    **MING_FLASH,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "intermediate_size": 4608,
    "moe_intermediate_size": 512,
}


@dataclass(frozen=True)
class PartShapes:
    """The sizes of every part besides the thinker, in the keys of each part's config file."""

    vision: dict[str, Any]
    whisper: dict[str, Any]
    talker_llm: dict[str, Any]  # without vocab_size: the talker tokenizer's size
    talker_dit: dict[str, Any]
    audio_vae_encoder: dict[str, Any]
    audio_vae_decoder: dict[str, Any]
    connector: dict[str, Any]
    image_dit: dict[str, Any]
    image_vae: dict[str, Any]


RELEASE_PARTS = PartShapes(
    release.VISION,
    release.WHISPER,
    release.TALKER_LLM,
    release.TALKER_DIT,
    release.AUDIO_VAE_BACKBONE,
    release.AUDIO_VAE_BACKBONE,
    release.CONNECTOR,
    release.IMAGE_DIT,
    release.IMAGE_VAE,
)
TINY_PARTS = PartShapes(
    TINY_VISION,
    TINY_WHISPER,
    tiny_talker.TINY_TALKER_LLM,
    tiny_talker.TINY_DIT,
    tiny_talker.TINY_VAE_ENCODER,
    tiny_talker.TINY_VAE_DECODER,
    tiny_imagegen.TINY_CONNECTOR,
    tiny_imagegen.TINY_DIT,
    tiny_imagegen.TINY_VAE,
)
SHAPES: dict[str, dict[str, Any]] = {
    "ming-flash": MING_FLASH,
    "ling-mini": LING_MINI,
    "ming-flash-tp2-rank": MING_FLASH_TP2_RANK,
    "tiny": {"vocab_size": 0, **TINY_LLM},  # vocab 0: just large enough for the tokenizer
}


def write_config_checkpoint(
    out_dir: str | Path, shape: str | dict[str, Any] = "ming-flash", parts: PartShapes | None = None
) -> Path:
    """Write the configs of every part and the tokenizers into `out_dir`, no weight files (serve it
    with `model.load_format: dummy`). `shape`: a name of SHAPES or a thinker shape dict; `parts`: the
    other parts' sizes (default: the tiny ones for "tiny", else the release's)."""
    dims = SHAPES[shape] if isinstance(shape, str) else shape
    parts = parts or (TINY_PARTS if shape == "tiny" else RELEASE_PARTS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tiny_tokenizer(out)
    if dims["vocab_size"]:  # the release's vocabulary: every id the dummy model samples decodes to a word
        pad_tokenizer(out, dims["vocab_size"])
    config = root_config(llm_config(dims, ids), parts.vision, parts.whisper)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "do_sample": False,
        "eos_token_id": [ids["<|role_end|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_talker_files(
        out,
        llm=parts.talker_llm,
        dit=parts.talker_dit,
        vae_encoder=parts.audio_vae_encoder,
        vae_decoder=parts.audio_vae_decoder,
    )
    write_imagegen_configs(out, connector=parts.connector, dit=parts.image_dit, vae=parts.image_vae)
    return out
