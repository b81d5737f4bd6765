"""RMSNorm as the reference modules compute it (diffusers' for the DiT, HF Qwen2's for the connector)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """The weight (`weight`, ones at init) and eps both references keep; they differ in the dtype they
    scale in (subclasses' `forward`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


class DiffusersRMSNorm(RMSNorm):
    """x · rsqrt(mean(x²) + eps) in float32, cast to the weight's dtype, then × weight (diffusers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return diffusers_rms_norm(x, self.weight, self.eps)


def diffusers_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`DiffusersRMSNorm`'s maths (also the fused kernels' reference)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(w.dtype) * w
