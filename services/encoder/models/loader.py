"""load_encoders: the vision and audio towers of a Ming checkpoint, built on meta and filled shard by shard."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omnistage.common.checkpoint import loading
from omnistage.common.checkpoint.dummy import fill_dummy_
from omnistage.common.checkpoint.shards import read_headers, shard_files
from omnistage.common.checkpoint.tiny import whisper_sinusoids
from omnistage.common.log import get_logger
from omnistage.services.encoder.models.audio import AudioEncoder
from omnistage.services.encoder.models.config import EncoderModelConfig, VisionConfig
from omnistage.services.encoder.models.vision import VisionEncoder
from torch import nn

log = get_logger(__name__)
ENCODER_PREFIXES = ("vision.", "linear_proj.", "audio.", "linear_proj_audio.")


@dataclass
class EncoderModels:
    """Both towers of one checkpoint, ready for inference."""

    config: EncoderModelConfig
    vision: VisionEncoder
    audio: AudioEncoder

    @property
    def weights_bytes(self) -> int:
        tensors = [*self.vision.parameters(), *self.audio.parameters(), *self.audio.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)


def is_encoder_key(key: str) -> bool:
    return key.startswith(ENCODER_PREFIXES)


def deepstack_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint keys of the unused deepstack mergers (post-shuffle LayerNorm over 4·hidden)."""
    merged = cfg.hidden_size * cfg.merge_unit
    out: dict[str, tuple[int, ...]] = {}
    for j in range(len(cfg.deepstack_visual_indexes)):
        p = f"vision.deepstack_merger_list.{j}."
        out |= {p + "norm.weight": (merged,), p + "norm.bias": (merged,)}
        out |= {p + "linear_fc1.weight": (merged, merged), p + "linear_fc1.bias": (merged,)}
        out |= {
            p + "linear_fc2.weight": (cfg.out_hidden_size, merged),
            p + "linear_fc2.bias": (cfg.out_hidden_size,),
        }
    return out


def _targets(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Checkpoint key → tensor to fill: parameters and persistent buffers (names equal the keys)."""
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        out.update(module.state_dict(keep_vars=True))
    return out


def build_encoders(
    config: EncoderModelConfig, *, dtype: torch.dtype, device: str | torch.device
) -> EncoderModels:
    """Empty towers (uninitialised parameters) in `dtype` on `device`; the loader or a benchmark fills them."""
    vision = loading.empty_on(lambda: VisionEncoder(config.vision), dtype=dtype, device=device)
    audio = loading.empty_on(lambda: AudioEncoder(config.audio), dtype=dtype, device=device)
    vision.vision.init_buffers()
    return EncoderModels(config, vision.requires_grad_(False).eval(), audio.requires_grad_(False).eval())


def load_encoders(
    checkpoint_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    progress: Callable[[int, int], None] | None = None,
    dummy: bool = False,
) -> EncoderModels:
    """Build both towers from a Ming checkpoint folder; `progress(done_shards, total_shards)`.
    `dummy`: only config.json is read, the weights are random (`model.load_format: dummy`)."""
    root = Path(checkpoint_dir)
    config = EncoderModelConfig.from_checkpoint(root)
    if dummy:
        return dummy_encoders(config, dtype=dtype, device=device, progress=progress)
    shards = shard_files(root)
    headers = read_headers(shards)
    models = build_encoders(config, dtype=dtype, device=device)
    targets = _targets([models.vision, models.audio])
    skipped = deepstack_shapes(config.vision)
    want = {**loading.state_shapes(targets), **skipped}
    loading.check_keys(
        root, "encoder weights do not match config.json", want, loading.shapes(headers, is_encoder_key)
    )

    mine = [
        s
        for s in shards
        if any(h.shard == s and is_encoder_key(k) and k not in skipped for k, h in headers.items())
    ]
    steps = loading.LoadProgress(len(mine), progress, log, "encoder weights", "shards")
    loaded: set[str] = set()
    for shard in mine:
        loaded |= loading.copy_shard(shard, headers, targets)
        steps.step()
    loading.check_all_loaded(root, "encoder tensors", targets, loaded)
    return models


def dummy_encoders(
    config: EncoderModelConfig,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    progress: Callable[[int, int], None] | None = None,
    seed: int = 0,
) -> EncoderModels:
    """Both towers with random weights in `dtype` on `device` (one progress step per tower)."""
    models = build_encoders(config, dtype=dtype, device=device)
    for n, (tower, offset) in enumerate(((models.vision, 0), (models.audio, 1)), start=1):
        fill_dummy_(tower, seed + offset)
        if progress is not None:
            progress(n, 2)
    a = config.audio
    models.audio.audio.positional_embedding.copy_(whisper_sinusoids(a.n_ctx, a.n_state, device=device))
    return models
