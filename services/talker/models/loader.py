"""load_talker: the talker's modules from a Ming checkpoint's `talker/` folder, built on the meta device
and filled tensor by tensor in the target dtype on the target device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omnistage.common.checkpoint import loading
from omnistage.common.checkpoint.dummy import fill_dummy_
from omnistage.common.checkpoint.shards import CheckpointError, read_headers, shard_files
from omnistage.common.log import get_logger
from omnistage.services.talker.models.audio_vae import AudioVAE
from omnistage.services.talker.models.config import TALKER_DIR, TalkerModelConfig
from omnistage.services.talker.models.dit import InterleavedRotary
from omnistage.services.talker.models.istft import ISTFT
from omnistage.services.talker.models.prompt import TalkerPrompt
from omnistage.services.talker.models.qwen2 import Qwen2Stack
from omnistage.services.talker.models.talker_lm import TalkerModel
from torch import nn

log = get_logger(__name__)
_UNUSED_VAE_SUFFIX = "embed_tokens.weight"


@dataclass
class TalkerModels:
    """Everything the talker engine runs, ready for inference."""

    config: TalkerModelConfig
    talker: TalkerModel
    vae: AudioVAE
    prompt: TalkerPrompt
    talker_dir: Path

    @property
    def device(self) -> torch.device:
        return self.talker.stop_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.talker.stop_head.weight.dtype

    @property
    def weights_bytes(self) -> int:
        tensors = [*self.talker.parameters(), *self.vae.parameters()]
        return sum(t.numel() * t.element_size() for t in tensors)


def _materialise(build: Callable[[], nn.Module], dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """Built on meta → empty `dtype` tensors on `device`; buffers recomputed (rotary tables and windows float32)."""
    module = loading.empty_on(build, dtype=dtype, device=device)
    for m in module.modules():
        if isinstance(m, Qwen2Stack | InterleavedRotary | ISTFT):
            m.init_buffers()
    return module.requires_grad_(False).eval()


def build_talker(
    config: TalkerModelConfig, *, dtype: torch.dtype, device: str | torch.device
) -> tuple[TalkerModel, AudioVAE]:
    """Empty modules (uninitialised parameters) in `dtype` on `device`; buffers computed."""
    return (
        _materialise(lambda: TalkerModel(config), dtype, device),
        _materialise(lambda: AudioVAE(config.vae), dtype, device),
    )


def _fill(
    module: nn.Module, folder: Path, optional_ok: Callable[[str], bool], progress: Callable[[], None]
) -> None:
    shards = shard_files(folder)
    headers = read_headers(shards)
    targets = module.state_dict(keep_vars=True)
    have = loading.shapes(headers)
    any_shape = {k: None for k in have if optional_ok(k)}
    loading.check_keys(
        folder, "talker weights do not match the configs", loading.state_shapes(targets), have, any_shape
    )
    loaded: set[str] = set()
    for shard in shards:
        loaded |= loading.copy_shard(shard, headers, targets)
        progress()
    loading.check_all_loaded(folder, "talker tensors", targets, loaded)


def load_talker(
    checkpoint_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    progress: Callable[[int, int], None] | None = None,
    dummy: bool = False,
) -> TalkerModels:
    """Build the talker from `<checkpoint_dir>/talker/`; `progress(done_shards, total_shards)`.
    `dummy`: random weights (`model.load_format: dummy`), one progress step per module."""
    tdir = Path(checkpoint_dir) / TALKER_DIR
    config = TalkerModelConfig.from_checkpoint(checkpoint_dir)
    prompt = TalkerPrompt(tdir)
    if prompt.vocab_size > config.llm.vocab_size:
        raise CheckpointError(
            f"{tdir}/llm: tokenizer has {prompt.vocab_size} tokens, the LM's vocab_size is "
            f"{config.llm.vocab_size}"
        )
    total = 2 if dummy else len(shard_files(tdir)) + len(shard_files(tdir / "vae"))
    steps = loading.LoadProgress(
        total, progress, log, "talker weights", "modules (dummy)" if dummy else "shards"
    )
    talker, vae = build_talker(config, dtype=dtype, device=device)
    if dummy:
        for seed, module in enumerate((talker, vae)):
            fill_dummy_(module, seed)
            steps.step()
    else:
        _fill(talker, tdir, lambda key: False, steps.step)
        _fill(vae, tdir / "vae", lambda key: key.endswith(_UNUSED_VAE_SUFFIX), steps.step)
    return TalkerModels(config, talker, vae, prompt, tdir)
