"""ThinkerConfig: the BailingMoeV2 shape read from the checkpoint's root `config.json` → `llm_config`.

Key names are the release's (ming.md §2.1). Special token ids come from `llm_config` and the
tokenizer files, never from constants, because the tiny checkpoint's ids differ from the release.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistage.common.checkpoint.config_files import read_added_tokens, read_json
from omnistage.common.checkpoint.shards import CheckpointError

# Token names whose ids the thinker stack needs; looked up in tokenizer_config.json.
_NAMED_TOKENS = {
    "image_end_token_id": "</image>",
    "video_start_token_id": "<video>",
    "video_end_token_id": "</video>",
    "audio_start_token_id": "<audio>",
    "audio_end_token_id": "</audio>",
    "audio_patch_token_id": "<audioPatch>",
    "role_end_token_id": "<|role_end|>",
}


@dataclass(frozen=True)
class ThinkerConfig:
    """Shape and routing hyper-parameters of the thinker LLM (one TP rank builds its slice from it)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    router_type: str
    rms_norm_eps: float
    use_qk_norm: bool
    use_qkv_bias: bool
    use_bias: bool
    rope_theta: float
    partial_rotary_factor: float
    rope_type: str  # "video_rope" (3D, ming.md §2.2) or "default" (1D)
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    spatial_merge_size: int = 2
    tokens_per_second: int = 2
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    image_patch_token_id: int | None = None
    video_patch_token_id: int | None = None
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None
    video_start_token_id: int | None = None
    video_end_token_id: int | None = None
    audio_start_token_id: int | None = None
    audio_end_token_id: int | None = None
    audio_patch_token_id: int | None = None
    role_end_token_id: int | None = None
    # Every added token of the tokenizer (name → id); empty when the checkpoint has no tokenizer files.
    special_tokens: dict[str, int] = field(default_factory=dict, compare=False, hash=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def multi_router(self) -> bool:
        return self.router_type == "MultiRouter"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.num_experts > 0

    @classmethod
    def from_dict(cls, llm: dict[str, Any], special_tokens: dict[str, int] | None = None) -> ThinkerConfig:
        """Build from an `llm_config` dict (+ tokenizer added tokens); missing required keys fail by name."""
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in llm]
        if missing:
            raise CheckpointError(f"llm_config lacks required keys: {', '.join(missing)}")
        heads = llm["num_attention_heads"]
        rope_scaling = llm.get("rope_scaling") or {}
        rope_type = rope_scaling.get("type") or rope_scaling.get("rope_type") or "default"
        # The release json names it moe_router_topk_scaling_factor; the reference code reads
        # routed_scaling_factor (class default 2.5). Prefer the explicit one.
        scaling = llm.get("routed_scaling_factor", llm.get("moe_router_topk_scaling_factor", 2.5))
        tokens = dict(special_tokens or {})
        named = {attr: tokens.get(name) for attr, name in _NAMED_TOKENS.items()}
        if named["video_start_token_id"] is None:
            # The release json's video_start_token is mislabelled (ming.md §2.1); only a fallback.
            named["video_start_token_id"] = llm.get("video_start_token")
        return cls(
            vocab_size=llm["vocab_size"],
            hidden_size=llm["hidden_size"],
            num_hidden_layers=llm["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=llm.get("num_key_value_heads") or heads,
            head_dim=llm.get("head_dim") or llm["hidden_size"] // heads,
            intermediate_size=llm.get("intermediate_size", 0),
            first_k_dense_replace=llm.get("first_k_dense_replace", 0),
            num_experts=llm.get("num_experts") or 0,
            num_experts_per_tok=llm.get("num_experts_per_tok", 0),
            num_shared_experts=llm.get("num_shared_experts") or 0,
            moe_intermediate_size=llm.get("moe_intermediate_size", 0),
            n_group=llm.get("n_group") or 1,
            topk_group=llm.get("topk_group") or 1,
            routed_scaling_factor=float(scaling),
            router_type=llm.get("router_type") or "TopkRouter",
            rms_norm_eps=llm.get("rms_norm_eps", 1e-6),
            use_qk_norm=bool(llm.get("use_qk_norm", False)),
            use_qkv_bias=bool(llm.get("use_qkv_bias", False)),
            use_bias=bool(llm.get("use_bias", False)),
            rope_theta=float(llm.get("rope_theta", 10000.0)),
            partial_rotary_factor=float(llm.get("partial_rotary_factor", 1.0)),
            rope_type=rope_type,
            max_position_embeddings=llm.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(llm.get("tie_word_embeddings", False)),
            hidden_act=llm.get("hidden_act", "silu"),
            spatial_merge_size=llm.get("spatial_merge_size", 2),
            tokens_per_second=llm.get("tokens_per_second", 2),
            eos_token_id=llm.get("eos_token_id", tokens.get("<|role_end|>")),
            pad_token_id=llm.get("pad_token_id", tokens.get("<|endoftext|>")),
            image_patch_token_id=llm.get("image_patch_token", tokens.get("<imagePatch>")),
            video_patch_token_id=llm.get("video_patch_token", tokens.get("<framePatch>")),
            image_start_token_id=llm.get("image_start_token", tokens.get("<image>")),
            special_tokens=tokens,
            **named,
        )

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path) -> ThinkerConfig:
        """Read `config.json` (`llm_config`, or a bare LLM config) and the tokenizer's added tokens."""
        root = Path(ckpt_dir)
        cfg = read_json(root / "config.json", "the thinker")
        llm = cfg.get("llm_config", cfg)
        return cls.from_dict(llm, read_added_tokens(root))
