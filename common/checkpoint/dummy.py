"""Random weights for `model.load_format: dummy`, made in place where the module already lives."""

from __future__ import annotations

import torch
from torch import nn

STD = 0.02


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, GroupNorm and every RMSNorm class of ours (their names end in `Norm`)."""
    return isinstance(module, nn.LayerNorm | nn.GroupNorm) or type(module).__name__.endswith("Norm")


@torch.no_grad()
def fill_dummy_(module: nn.Module, seed: int = 0) -> None:
    """Fill `module`'s parameters in place (see the module docstring); buffers are left to their owners."""
    params = list(module.parameters())
    if not params:
        return
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    for sub in module.modules():
        norm = is_norm(sub)
        for leaf, p in sub.named_parameters(recurse=False):
            if norm:
                p.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                p.zero_()
            else:
                p.normal_(0.0, STD, generator=gen)
