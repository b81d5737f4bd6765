"""Writes a tiny random-weight checkpoint in the Ming-flash-omni-2.0 HF layout (ming.md §2.4, §3.3, §4.4).

Same root `config.json` keys, same tensor names, bf16 storage, several shards + index, a small
tokenizer with the real special tokens (other ids), the talker's `talker/` folder (tiny_talker.py)
and the image-generation folders (tiny_imagegen.py). The thinker keeps the real head_dim 128 with partial rotary 0.5 so the [8, 12, 12]
video_rope split is the release's. Deterministic for a seed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from omnistage.common.checkpoint.part_shapes import vision_shape, whisper_shape
from omnistage.common.checkpoint.seeded import SeededInit
from omnistage.common.checkpoint.shards import write_sharded
from omnistage.common.checkpoint.tiny_imagegen import write_tiny_imagegen
from omnistage.common.checkpoint.tiny_talker import write_tiny_talker
from omnistage.common.checkpoint.tiny_tokenizer import write_tiny_tokenizer

NUM_SHARDS = 4
VOCAB_MULTIPLE = 64

TINY_LLM: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 512,
    "first_k_dense_replace": 1,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "num_shared_experts": 1,
    "moe_intermediate_size": 64,
    "n_group": 4,
    "topk_group": 2,
}

TINY_VISION = vision_shape(
    depth=3,
    hidden_size=64,
    num_heads=4,
    intermediate_size=128,
    num_position_embeddings=64,
    out_hidden_size=256,
    deepstack_visual_indexes=[0, 1, 2],
)

TINY_WHISPER = whisper_shape(n_ctx=200, n_state=64, n_head=4, n_layer=2)


def llm_config(shape: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    """The release's `llm_config` keys (ming.md §2.1) for the thinker `shape` (TINY_LLM, a release shape),
    special ids from the tokenizer; no `vocab_size` in `shape`: the smallest multiple of 64 holding them."""
    vocab = shape.get("vocab_size") or -(-(max(ids.values()) + 1) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if vocab <= max(ids.values()):
        raise ValueError(
            f"vocab_size {vocab} does not hold the tokenizer's ids (largest {max(ids.values())})"
        )
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
        "norm_head": False,
        "norm_softmax": False,
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
        # The release stores the id of `</image>` here (mislabelled, ming.md §2.1); kept faithfully.
        "video_start_token": ids["</image>"],
        "torch_dtype": "bfloat16",
    }


def root_config(
    llm_config: dict[str, Any], vision: dict[str, Any], whisper: dict[str, Any]
) -> dict[str, Any]:
    """The root `config.json` (ming.md §2.1, §3.1, §4.1): the thinker's `llm_config` and the encoders'
    configs (the release stores the vision tower in float32)."""
    return {
        "architectures": ["BailingMM2NativeForConditionalGeneration"],
        "model_type": "bailingmm_moe_v2_lite",
        "mlp_depth": 2,
        "llm_config": llm_config,
        "vision_config": {**vision, "torch_dtype": "float32"},
        "audio_config": {
            "whisper_encoder_config": dict(whisper),
            "ds_kernel_size": 3,
            "ds_stride": 2,
            "norm_query_embeds": True,
        },
        "torch_dtype": "bfloat16",
    }


def _thinker_tensors(init: SeededInit, vocab: int) -> dict[str, torch.Tensor]:
    c = TINY_LLM
    h, hd, L = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    qkv_rows = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    E, mi = c["num_experts"], c["moe_intermediate_size"]
    # Embeddings at unit scale so token identity survives the random layers (non-degenerate greedy).
    t: dict[str, torch.Tensor] = {"model.model.word_embeddings.weight": init.normal(vocab, h, std=1.0)}
    for i in range(L):
        p = f"model.model.layers.{i}."
        t[p + "input_layernorm.weight"] = init.norm(h)
        t[p + "post_attention_layernorm.weight"] = init.norm(h)
        t[p + "attention.query_key_value.weight"] = init.normal(qkv_rows, h)
        t[p + "attention.q_norm.weight"] = init.norm(hd)
        t[p + "attention.k_norm.weight"] = init.norm(hd)
        t[p + "attention.dense.weight"] = init.normal(h, c["num_attention_heads"] * hd)
        if i < c["first_k_dense_replace"]:
            t[p + "mlp.gate_proj.weight"] = init.normal(c["intermediate_size"], h)
            t[p + "mlp.up_proj.weight"] = init.normal(c["intermediate_size"], h)
            t[p + "mlp.down_proj.weight"] = init.normal(h, c["intermediate_size"])
            continue
        for gate in ("gate", "image_gate", "audio_gate"):
            t[p + f"mlp.{gate}.weight"] = init.normal(E, h, std=0.1)
            t[p + f"mlp.{gate}.expert_bias"] = init.normal(E, std=0.05)
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = init.normal(mi, h)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = init.normal(mi, h)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = init.normal(h, mi)
        sw = mi * c["num_shared_experts"]
        t[p + "mlp.shared_experts.gate_proj.weight"] = init.normal(sw, h)
        t[p + "mlp.shared_experts.up_proj.weight"] = init.normal(sw, h)
        t[p + "mlp.shared_experts.down_proj.weight"] = init.normal(h, sw)
    t["model.model.norm.weight"] = init.norm(h)
    t["model.lm_head.weight"] = init.normal(vocab, h)
    return t


def _vision_tensors(init: SeededInit, llm_hidden: int) -> dict[str, torch.Tensor]:
    c = TINY_VISION
    d, p, tp = c["hidden_size"], c["patch_size"], c["temporal_patch_size"]
    merged = d * c["spatial_merge_size"] ** 2
    t: dict[str, torch.Tensor] = {
        "vision.patch_embed.proj.weight": init.normal(d, c["in_channels"], tp, p, p),
        "vision.patch_embed.proj.bias": init.normal(d),
        "vision.pos_embed.weight": init.normal(c["num_position_embeddings"], d),
    }
    for i in range(c["depth"]):
        b = f"vision.blocks.{i}."
        init.layernorm(t, b + "norm1", d)
        init.layernorm(t, b + "norm2", d)
        init.linear(t, b + "attn.qkv", 3 * d, d)
        init.linear(t, b + "attn.proj", d, d)
        init.linear(t, b + "mlp.linear_fc1", c["intermediate_size"], d)
        init.linear(t, b + "mlp.linear_fc2", d, c["intermediate_size"])
    init.layernorm(t, "vision.merger.norm", d)
    init.linear(t, "vision.merger.linear_fc1", merged, merged)
    init.linear(t, "vision.merger.linear_fc2", c["out_hidden_size"], merged)
    for j in range(len(c["deepstack_visual_indexes"])):
        b = f"vision.deepstack_merger_list.{j}."
        init.layernorm(t, b + "norm", merged)
        init.linear(t, b + "linear_fc1", merged, merged)
        init.linear(t, b + "linear_fc2", c["out_hidden_size"], merged)
    init.linear(t, "linear_proj.0", llm_hidden, c["out_hidden_size"])
    init.linear(t, "linear_proj.2", llm_hidden, llm_hidden)
    return t


def whisper_sinusoids(
    length: int, channels: int, max_timescale: float = 10000.0, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Whisper's fixed positional table: [sin | cos] over geometrically spaced timescales (float32)."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float64, device=device))
    t = torch.arange(length, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1).float()


def _audio_tensors(init: SeededInit, llm_hidden: int) -> dict[str, torch.Tensor]:
    c = TINY_WHISPER
    s, m = c["n_state"], c["n_mels"]
    t: dict[str, torch.Tensor] = {
        "audio.conv1.weight": init.normal(s, m, 3),
        "audio.conv1.bias": init.normal(s),
        "audio.conv2.weight": init.normal(s, s, 3),
        "audio.conv2.bias": init.normal(s),
        "audio.positional_embedding": whisper_sinusoids(c["n_ctx"], s),
    }
    for i in range(c["n_layer"]):
        b = f"audio.blocks.{i}."
        for name in ("query", "value", "out"):
            init.linear(t, b + f"attn.{name}", s, s)
        t[b + "attn.key.weight"] = init.normal(s, s)
        init.layernorm(t, b + "attn_ln", s)
        init.linear(t, b + "mlp.0", 4 * s, s)
        init.linear(t, b + "mlp.2", s, 4 * s)
        init.layernorm(t, b + "mlp_ln", s)
    init.layernorm(t, "audio.ln_post", s)
    t["linear_proj_audio.0.weight"] = init.normal(llm_hidden, s, 3)
    t["linear_proj_audio.0.bias"] = init.normal(llm_hidden)
    init.linear(t, "linear_proj_audio.3", llm_hidden, llm_hidden)
    return t


def write_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny Ming checkpoint (config, bf16 shards + index, tokenizer, the `talker/` folder) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tiny_tokenizer(out)
    llm = llm_config(TINY_LLM, ids)
    vocab = llm["vocab_size"]
    config = root_config(llm, TINY_VISION, TINY_WHISPER)
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    generation = {
        "do_sample": False,
        "eos_token_id": [ids["<|role_end|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "max_new_tokens": 512,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    init = SeededInit(seed)
    hidden = TINY_LLM["hidden_size"]
    tensors = {
        **_thinker_tensors(init, vocab),
        **_vision_tensors(init, hidden),
        **_audio_tensors(init, hidden),
    }
    write_sharded({k: v.to(torch.bfloat16) for k, v in tensors.items()}, out, NUM_SHARDS)
    write_tiny_talker(out, seed=seed)
    write_tiny_imagegen(out, thinker_hidden=hidden, seed=seed)
    return out
