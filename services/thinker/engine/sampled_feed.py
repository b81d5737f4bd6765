"""SampledFeed: the last step's sampled ids, kept on each rank's device for the next step's inputs.

With async scheduling the next step is planned and launched before the ids of the step running now
reach the host: its plan names them by placeholders (`sequence.placeholder`: row r is -r - 1), and
each rank puts the ids in their place on its device. Rank 0 samples (its greedy ids straight into
the feed's buffer, `SampledFeed.target`); under TP its ids reach the other ranks by a broadcast on
the device after the step (`StepPlan.share_sampled`), so a decode step's plan never waits for a
host to learn the new tokens.
"""

from __future__ import annotations

import torch
from omnistage.services.thinker.models.layers.embed_head import resolve_placeholders
from omnistage.services.thinker.models.layers.parallel import TPGroup
from omnistage.services.thinker.tp.plan import StepPlan


class SampledFeed:
    """One rank's copy of the latest shared step's sampled ids [R] (int64, on its device), kept in one
    buffer of `capacity` rows (the most a step samples: one a sequence) at a fixed address, so that
    a decode graph reads them in its own replay (the model's embedding lookup takes the raw ids and
    `buffer`: engine/cuda_graphs.py) instead of the host queuing the gather before it."""

    def __init__(self, device: torch.device, group: TPGroup, capacity: int = 256) -> None:
        self.device = device
        self.group = group
        self.buffer = torch.zeros(max(1, capacity), dtype=torch.int64, device=device)
        self.ids: torch.Tensor | None = None

    def target(self, plan: StepPlan) -> torch.Tensor:
        """Where rank 0 samples `plan`'s ids [R] (the buffer's first rows), so that `share` has
        nothing to copy."""
        rows = plan.num_sample_rows
        if rows > self.buffer.numel():
            raise RuntimeError(f"a step sampled {rows} rows, more than the feed's {self.buffer.numel()}")
        return self.buffer[:rows]

    def share(self, plan: StepPlan, tokens: torch.Tensor | None = None) -> None:
        """After `plan` ran: rank 0 passes its sampled `tokens` [R] (copied in unless they already
        are `target(plan)`), the other ranks receive them (every rank calls this in the same place:
        it is a collective under TP)."""
        ids = self.target(plan)
        if self.group.rank == 0:
            assert tokens is not None and tokens.numel() == ids.numel(), "rank 0 shares its tokens"
            if not (tokens.is_contiguous() and tokens.data_ptr() == ids.data_ptr()):
                ids.copy_(tokens.reshape(-1))
        self.ids = self.group.broadcast_from_first(ids)

    def require_shared(self) -> None:
        """Raise unless a step shared its ids (a plan that names them before any did is a bug)."""
        if self.ids is None or self.ids.numel() == 0:
            raise RuntimeError("step plan names sampled ids, but no step shared any")

    def fill(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (on the device) with each placeholder replaced by the id it names (a new tensor)."""
        self.require_shared()
        return resolve_placeholders(ids, self.ids)
