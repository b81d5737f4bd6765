"""Seeded random tensors for the tiny checkpoints: one generator per part, sensible scales (linears
N(0, std), norms around 1), so a given seed writes the same checkpoint every time."""

from __future__ import annotations

import torch

Tensors = dict[str, torch.Tensor]


class SeededInit:
    """Random tensors in float32 from one seeded generator, in the order they are asked for."""

    def __init__(self, seed: int, *, linear_std: float = 0.02) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.linear_std = linear_std

    def normal(self, *shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * std + mean

    def norm(self, n: int) -> torch.Tensor:
        """A norm's weight: around 1."""
        return self.normal(n, std=0.05, mean=1.0)

    def linear(
        self, t: Tensors, name: str, out_f: int, in_f: int, bias: bool = True, std: float | None = None
    ) -> None:
        """`name.weight` (std `std`, default `linear_std`) and `name.bias` (std 0.02) into `t`."""
        t[name + ".weight"] = self.normal(out_f, in_f, std=self.linear_std if std is None else std)
        if bias:
            t[name + ".bias"] = self.normal(out_f, std=0.02)

    def layernorm(self, t: Tensors, name: str, n: int) -> None:
        t[name + ".weight"] = self.norm(n)
        t[name + ".bias"] = self.normal(n)
