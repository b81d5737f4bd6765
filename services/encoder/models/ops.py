"""Small tensor ops shared by the vision and audio towers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def layer_norm_fp32(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm computed in float32 (the reference's fp32 LayerNorm / autocast), result in float32."""
    w = norm.weight.float() if norm.weight is not None else None
    b = norm.bias.float() if norm.bias is not None else None
    return F.layer_norm(x.float(), norm.normalized_shape, w, b, norm.eps)
