"""RMSNorm as the reference modules compute it (diffusers' for the DiT, HF Qwen2's for the connector)."""

from __future__ import annotations

import torch
from torch import nn


class DiffusersRMSNorm(nn.Module):
    """x · rsqrt(mean(x²) + eps) in float32, cast to the weight's dtype, then × weight (diffusers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return diffusers_rms_norm(x, self.weight, self.eps)


def diffusers_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`DiffusersRMSNorm`'s maths (also the fused kernels' reference)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(w.dtype) * w


class Qwen2RMSNorm(nn.Module):
    """Normalised in float32, cast back to the input dtype, then × weight (HF Qwen2)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
