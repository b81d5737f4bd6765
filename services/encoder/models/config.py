"""Encoder shapes read from the checkpoint's root `config.json` (ming.md §3.1, §4.1, §7.1).

`vision_config` and `audio_config.whisper_encoder_config` give the towers, `llm_config.hidden_size`
the projectors' output width, `mlp_depth` the vision projector depth. Placeholder token ids come from
`llm_config` (`image_patch_token`, `video_patch_token`) and the tokenizer's added tokens
(`<audioPatch>`), never from constants: the tiny checkpoint's ids differ from the release's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.common.checkpoint.config_files import read_added_tokens, read_json, require_keys, take
from omnistage.common.checkpoint.shards import CheckpointError


@dataclass(frozen=True)
class VisionConfig:
    """Qwen3-VL-style ViT + `linear_proj` (ming.md §3.1)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    projector_size: int  # llm hidden size: linear_proj output
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    deepstack_visual_indexes: tuple[int, ...] = ()
    mlp_depth: int = 2
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: C x T x P x P (1536 for Ming)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def pixels_per_token(self) -> int:
        """Side of one merged token in pixels (32 for Ming): the smart_resize factor."""
        return self.patch_size * self.spatial_merge_size


@dataclass(frozen=True)
class AudioConfig:
    """openai-whisper AudioEncoder + `linear_proj_audio` (ming.md §4.1)."""

    n_mels: int
    n_ctx: int  # positions after conv2: the longest clip is 2 x n_ctx mel frames
    n_state: int
    n_head: int
    n_layer: int
    projector_size: int
    ds_kernel_size: int = 3
    ds_stride: int = 2
    norm_query_embeds: bool = True


@dataclass(frozen=True)
class PlaceholderIds:
    """Token ids whose prompt positions receive encoder rows."""

    image_patch: int
    video_patch: int
    audio_patch: int


@dataclass(frozen=True)
class EncoderModelConfig:
    vision: VisionConfig
    audio: AudioConfig
    placeholders: PlaceholderIds

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path) -> EncoderModelConfig:
        root = Path(ckpt_dir)
        path = root / "config.json"
        return cls.from_dict(read_json(path, "the encoders"), read_added_tokens(root), where=str(path))

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], tokens: dict[str, int], where: str = "config.json"
    ) -> EncoderModelConfig:
        for key in ("vision_config", "audio_config", "llm_config"):
            if not isinstance(cfg.get(key), dict):
                raise CheckpointError(f"{where}: no {key} (not a Ming omni checkpoint?)")
        llm = cfg["llm_config"]
        return cls(
            vision=_vision(cfg["vision_config"], llm, cfg.get("mlp_depth", 2), where),
            audio=_audio(cfg["audio_config"], llm, where),
            placeholders=_placeholders(llm, tokens, where),
        )


_VISION_KEYS = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size")
_VISION_OPTIONAL = (
    "patch_size",
    "temporal_patch_size",
    "in_channels",
    "spatial_merge_size",
    "num_position_embeddings",
    "hidden_act",
)
_WHISPER_KEYS = ("n_mels", "n_ctx", "n_state", "n_head", "n_layer")


def _vision(v: dict[str, Any], llm: dict[str, Any], mlp_depth: int, where: str) -> VisionConfig:
    keys = take(v, _VISION_KEYS, _VISION_OPTIONAL, f"{where} vision_config")
    require_keys(llm, ("hidden_size",), f"{where} llm_config")
    if mlp_depth != 2:
        raise CheckpointError(f"{where}: mlp_depth {mlp_depth} is not supported (Ming uses 2)")
    if v["hidden_size"] % v["num_heads"]:
        raise CheckpointError(f"{where} vision_config: hidden_size not divisible by num_heads")
    return VisionConfig(
        **keys,
        projector_size=llm["hidden_size"],
        mlp_depth=mlp_depth,
        deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes") or ()),
    )


def _audio(a: dict[str, Any], llm: dict[str, Any], where: str) -> AudioConfig:
    w = a.get("whisper_encoder_config")
    if not isinstance(w, dict):
        raise CheckpointError(f"{where} audio_config: no whisper_encoder_config")
    return AudioConfig(
        **take(w, _WHISPER_KEYS, (), f"{where} whisper_encoder_config"),
        **take(a, (), ("ds_kernel_size", "ds_stride"), f"{where} audio_config"),
        projector_size=llm["hidden_size"],
        norm_query_embeds=bool(a.get("norm_query_embeds", True)),
    )


def _placeholders(llm: dict[str, Any], tokens: dict[str, int], where: str) -> PlaceholderIds:
    ids = {
        "image_patch": llm.get("image_patch_token", tokens.get("<imagePatch>")),
        "video_patch": llm.get("video_patch_token", tokens.get("<framePatch>")),
        "audio_patch": tokens.get("<audioPatch>"),
    }
    if missing := [k for k, v in ids.items() if v is None]:
        raise CheckpointError(
            f"{where}: placeholder token ids not found for {', '.join(missing)} "
            "(llm_config image_patch_token / video_patch_token, tokenizer_config.json <audioPatch>)"
        )
    return PlaceholderIds(**{k: int(v) for k, v in ids.items()})
