"""SampledFeed: the last step's sampled ids, kept on each rank's device for the next step's inputs.

With async scheduling the next step is planned and launched before the ids of the step running now
reach the host: its plan names them by placeholders (`sequence.placeholder`: row r is -r - 1), and
each rank puts the ids in their place on its device. Rank 0 samples; under TP its ids reach the other
ranks by a broadcast on the device after the step (`StepPlan.share_sampled`), so a decode step's plan
never waits for a host to learn the new tokens.
"""

from __future__ import annotations

import torch
from omnistage.services.thinker.models.layers.parallel import TPGroup
from omnistage.services.thinker.tp.plan import StepPlan


class SampledFeed:
    """One rank's copy of the latest shared step's sampled ids [R] (int64, on its device)."""

    def __init__(self, device: torch.device, group: TPGroup) -> None:
        self.device = device
        self.group = group
        self.ids: torch.Tensor | None = None

    def share(self, plan: StepPlan, tokens: torch.Tensor | None = None) -> None:
        """After `plan` ran: rank 0 passes its sampled `tokens` [R], the other ranks receive them
        (every rank calls this in the same place: it is a collective under TP)."""
        if self.group.rank == 0:
            assert tokens is not None and tokens.numel() == plan.num_sample_rows, "rank 0 shares its tokens"
            ids = tokens.to(self.device, torch.int64)
        else:
            ids = torch.empty(plan.num_sample_rows, dtype=torch.int64, device=self.device)
        self.ids = self.group.broadcast_from_first(ids)

    def fill(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (on the device) with each placeholder replaced by the id it names (a new tensor)."""
        if self.ids is None or self.ids.numel() == 0:
            raise RuntimeError("step plan names sampled ids, but no step shared any")
        named = self.ids[(-ids - 1).clamp(min=0, max=self.ids.numel() - 1)]
        return torch.where(ids < 0, named, ids)
