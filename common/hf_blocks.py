"""Torch building blocks that several stages' reference models (HuggingFace Qwen2 and its kin) share:
one copy of each, so a stage copies nothing from another. Each computes exactly what transformers'
module of the same name computes (dtype casts included); parameter names are the checkpoints'."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[a, b] → [−b, a] over the last dim (NeoX-style rotary)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Qwen2RMSNorm(nn.Module):
    """Normalised in float32, cast back to the input dtype, then × weight (transformers' Qwen2RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Qwen2MLP(nn.Module):
    """down(silu(gate(x)) · up(x)), no biases (transformers' Qwen2MLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
