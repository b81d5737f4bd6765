"""RMSNorm as the reference computes it: statistics in fp32, cast back, then times the weight.

With `residual` it first adds the residual stream (x + residual, in the activation dtype) and
returns that sum too, so a decoder layer hands one tensor pair along (nano-vllm's shape) and a
fused kernel (`kernel`, set by layers/backends.py) can do add + norm in one launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # rms_norm(x, weight, eps, residual) with this forward's results; None: the reference below.
        self.kernel: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        out = rms_norm_reference(x, self.weight, self.eps)
        return out if residual is None else (out, residual)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * norm(x) over the last dim: statistics in fp32, the normed x cast back to x's dtype
    before the weight multiply (ming.md §8.4: bf16 results depend on this order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
