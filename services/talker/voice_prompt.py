"""A voice as the talker LM and the CFM use it: speaker embedding, prompt text, prompt latents and their
patch embeddings (made by voices.py; plain tensors here so the engine needs no audio decoding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CUSTOM = "custom"


@dataclass(frozen=True)
class Voice:
    name: str  # preset name, or "custom"
    prompt_text: str
    speaker: torch.Tensor  # [hidden] LM embedding of the speaker vector
    latents: torch.Tensor  # [patches · patch_size, latent_dim] float32
    embeddings: torch.Tensor  # [patches, hidden]

    @property
    def patches(self) -> int:
        return self.embeddings.shape[0]
