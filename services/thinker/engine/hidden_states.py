"""Hidden-state mode: the final-norm hidden states a request asks for, collected as its prefill runs."""

from __future__ import annotations

import torch
from omnistage.services.thinker.engine.media import slot_span


class HiddenCapture:
    """The rows of one hidden-state request: slot k's final-norm hidden state goes to row k."""

    def __init__(self, slots: torch.Tensor) -> None:
        if slots.dim() != 1 or slots.numel() == 0:
            raise ValueError(f"HiddenCapture: slots must be a non-empty 1-D tensor, got {list(slots.shape)}")
        if slots.numel() > 1 and not bool((slots[1:] > slots[:-1]).all()):
            raise ValueError("HiddenCapture: slots must be strictly increasing")
        self.slots = slots.to(torch.long)
        self.rows: torch.Tensor | None = None  # [N, H], allocated by the first chunk that reaches a slot

    @property
    def num_rows(self) -> int:
        return int(self.slots.numel())

    def span(self, start: int, end: int) -> tuple[int, int]:
        """[lo, hi): the slots in token range [start, end)."""
        return slot_span(self.slots, start, end)

    def store(self, lo: int, rows: torch.Tensor) -> None:
        """Rows of slots lo .. lo + len(rows) - 1 (one step's chunk)."""
        if self.rows is None:
            self.rows = torch.empty(self.num_rows, rows.shape[1], dtype=rows.dtype, device=rows.device)
        self.rows[lo : lo + rows.shape[0]] = rows
