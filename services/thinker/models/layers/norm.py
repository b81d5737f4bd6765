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
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight (ming.md §8.4): bf16 results depend on this order.
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
