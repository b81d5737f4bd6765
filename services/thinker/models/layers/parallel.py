"""Tensor-parallel group of the thinker: rank/size plus the collectives the layers (and the runner) need.

Uses the default torch.distributed group (gloo on CPU, NCCL on GPU); at size 1 every collective is a
no-op, so single-process code never touches torch.distributed. A faster sum for small messages
(`SmallAllReduce`, the one-shot peer all-reduce of `tp/peer_allreduce.py`) is given to the group at
start-up when every rank agreed on it; the layers never know which sum ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division or a clear error naming the quantity that TP cannot split."""
    if numerator % denominator:
        raise ValueError(f"tensor parallel size {denominator} does not divide {what} ({numerator})")
    return numerator // denominator


class SmallAllReduce(Protocol):
    """A sum over the ranks for the messages it takes; torch.distributed sums the others. `takes`
    reads only what is the same on every rank for the same call (dtype, size, layout, device)."""

    def takes(self, x: torch.Tensor) -> bool: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the TP group; layers take their slice from `rank` and `size`."""

    rank: int = 0
    size: int = 1
    small_all_reduce: SmallAllReduce | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor parallel rank {self.rank} of size {self.size}")

    @classmethod
    def from_default_group(cls) -> TPGroup:
        """The default torch.distributed group, or a single rank when none is initialised."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def check_initialised(self) -> None:
        """Ranks > 1 need the default group to exist and match; say what is wrong otherwise."""
        if self.size == 1:
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"tp_size={self.size} needs torch.distributed initialised (default group)")
        if dist.get_world_size() != self.size or dist.get_rank() != self.rank:
            raise RuntimeError(
                f"tp rank/size {self.rank}/{self.size} differ from the default group's "
                f"{dist.get_rank()}/{dist.get_world_size()}"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum across ranks (in place); identity at size 1."""
        if self.size == 1:
            return x
        fast = self.small_all_reduce
        if fast is not None and fast.takes(x):
            return fast(x)
        dist.all_reduce(x)
        return x

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place: the others pass a buffer of its shape); identity at size 1."""
        if self.size == 1:
            return x
        dist.broadcast(x, src=0)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` in rank order; identity at size 1."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)
