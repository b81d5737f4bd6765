"""load_imagegen: connector, DiT and VAE of a Ming checkpoint, built on meta and filled folder by folder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omnistage.common.checkpoint.loading import (
    LoadProgress,
    check_keys,
    copy_shard,
    empty_on,
    shapes,
    state_shapes,
)
from omnistage.common.checkpoint.shards import CheckpointError, TensorInfo, read_headers, shard_files
from omnistage.common.hf_blocks import Qwen2RMSNorm
from omnistage.common.log import get_logger
from omnistage.services.imagegen.models.config import ImageGenModelConfig
from omnistage.services.imagegen.models.connector import ConditionEncoder
from omnistage.services.imagegen.models.dit import ZImageDiT
from omnistage.services.imagegen.models.norms import DiffusersRMSNorm
from omnistage.services.imagegen.models.scheduler import Schedule, make_schedule
from omnistage.services.imagegen.models.vae import AutoencoderKL
from torch import nn

log = get_logger(__name__)
DIFFUSERS_STEM = "diffusion_pytorch_model"
_NORMS = (nn.LayerNorm, nn.GroupNorm, DiffusersRMSNorm, Qwen2RMSNorm)


@dataclass
class ImageGenModels:
    """Everything one generation needs, ready for inference."""

    config: ImageGenModelConfig
    cond: ConditionEncoder
    dit: ZImageDiT
    vae: AutoencoderKL

    @property
    def weights_bytes(self) -> int:
        mods = (self.cond, self.dit, self.vae)
        return sum(t.numel() * t.element_size() for m in mods for t in [*m.parameters(), *m.buffers()])

    def schedule(self, steps: int, image_seq_len: int) -> Schedule:
        return make_schedule(self.config.scheduler, steps, image_seq_len)


@dataclass(frozen=True)
class _Part:
    """One checkpoint folder: its shard stem, file key → tensor to fill, and checked-only shapes."""

    folder: str
    stem: str
    targets: dict[str, torch.Tensor]
    skipped: dict[str, tuple[int, ...]]
    optional: dict[str, tuple[int, ...]]


def build_models(
    config: ImageGenModelConfig, *, dtype: torch.dtype, device: str | torch.device
) -> ImageGenModels:
    """Empty modules (uninitialised parameters) in `dtype` on `device`; the loader or `random_init` fills them."""
    builds = (
        lambda: ConditionEncoder(
            config.mlp, config.connector, config.thinker_hidden, config.dit.cap_feat_dim
        ),
        lambda: ZImageDiT(config.dit),
        lambda: AutoencoderKL(config.vae),
    )
    cond, dit, vae = (empty_on(b, dtype=dtype, device=device).requires_grad_(False).eval() for b in builds)
    dit.rope.init_buffers(config.dit)
    return ImageGenModels(config, cond, dit, vae)


def _state(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in module.state_dict(keep_vars=True).items()}


def _parts(models: ImageGenModels) -> list[_Part]:
    cfg = models.config
    cond = models.cond
    mlp_targets = {
        **_state(cond.proj_in, "proj_in."),
        **_state(cond.proj_out, "proj_out."),
        **_state(cond.mlp, "mlp."),
    }
    queries = {f"query_tokens_dict.{s}x{s}": (s * s, cfg.thinker_hidden) for s in cfg.mlp.img_gen_scales}
    c = cfg.connector
    embed = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    head = {"lm_head.weight": (c.vocab_size, c.hidden_size)}
    return [
        _Part("mlp", "model", mlp_targets, queries, {}),
        _Part(
            "connector",
            "model",
            _state(cond.connector),
            {**embed, **({} if c.tie_word_embeddings else head)},
            head if c.tie_word_embeddings else {},
        ),
        _Part("transformer", DIFFUSERS_STEM, _state(models.dit), {}, {}),
        _Part("vae", DIFFUSERS_STEM, _state(models.vae), {}, {}),
    ]


def _check_keys(where: Path, part: _Part, headers: dict[str, TensorInfo]) -> None:
    check_keys(
        where,
        "weights do not match its config",
        {**state_shapes(part.targets), **part.skipped},
        shapes(headers),
        part.optional,
    )


def _shards(folder: Path, stem: str) -> list[Path]:
    for s in (stem, "model"):
        try:
            return shard_files(folder, stem=s)
        except CheckpointError:
            continue
    return shard_files(folder, stem=stem)  # raises, naming the expected files


def load_imagegen(
    checkpoint_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    progress: Callable[[int, int], None] | None = None,
    dummy: bool = False,
) -> ImageGenModels:
    """Build every part from a Ming checkpoint folder; `progress(done_shards, total_shards)`.

    `dummy`: only the config files are read; weights are random (benchmarks, `load_format: dummy`).
    """
    root = Path(checkpoint_dir)
    config = ImageGenModelConfig.from_checkpoint(root)
    models = build_models(config, dtype=dtype, device=device)
    if dummy:
        random_init(models)
        return models
    parts = _parts(models)
    plan: list[tuple[_Part, Path, dict[str, TensorInfo]]] = []
    for part in parts:
        folder = root / part.folder
        shards = _shards(folder, part.stem)
        headers = read_headers(shards)
        _check_keys(folder, part, headers)
        plan.extend((part, shard, {k: h for k, h in headers.items() if h.shard == shard}) for shard in shards)
    steps = LoadProgress(len(plan), progress, log, "imagegen weights", "shards")
    for part, shard, headers in plan:
        copy_shard(shard, headers, part.targets)
        steps.step(part.folder)
    return models


@torch.no_grad()
def random_init(models: ImageGenModels, seed: int = 0) -> None:
    """In place, on the modules' device: weights N(0, 0.02), biases 0, norms 1, pad tokens N(0, 0.02)."""
    for i, module in enumerate((models.cond, models.dit, models.vae)):
        params = list(module.named_parameters())
        gen = torch.Generator(device=params[0][1].device).manual_seed(seed + i)
        for name, p in params:
            leaf = name.rpartition(".")[2]
            owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
            if isinstance(owner, _NORMS):
                p.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
