"""build_step_plan: the scheduled sequences of one step as the plan every rank runs (tp/plan.py)."""

from __future__ import annotations

import torch
from omnistage.services.thinker.engine.sequence import Sequence
from omnistage.services.thinker.tp.plan import PlanKind, StepPlan, empty_int64


def build_step_plan(scheduled: list[tuple[Sequence, int]], block_size: int) -> StepPlan:
    """Plan for sequences each computing its next `n` uncomputed tokens; rows sample where a sequence
    reaches its last known token (prefill finished or decode), unless it is a hidden-state request,
    whose chunk instead keeps the hidden states of the slots it covers (`hidden_index`, batch order).
    A chunk that covers placeholder slots takes exactly the encoder rows of those slots (recompute
    after a preemption takes them again)."""
    ids: list[int] = []
    pos: list[list[int]] = [[], [], []]
    qlens, clens, slots, rows, tables = [], [], [], [], []
    media_index: list[torch.Tensor] = []
    media_modality: list[torch.Tensor] = []
    media_rows: list[torch.Tensor] = []
    hidden_index: list[torch.Tensor] = []
    for seq, n in scheduled:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        if seq.media is not None and start < seq.num_prompt_tokens:
            lo, hi = seq.media.span(start, end)
            if hi > lo:
                media_index.append(seq.media.slots[lo:hi] - start + len(ids))
                media_modality.append(seq.media.modality[lo:hi])
                media_rows.append(seq.media.rows[lo:hi])
        if seq.hidden is not None:
            lo, hi = seq.hidden.span(start, end)
            hidden_index.append(seq.hidden.slots[lo:hi] - start + len(ids))
        ids.extend(seq.token_ids[start:end])
        for axis, row in enumerate(seq.positions(start, end)):
            pos[axis].extend(row)
        for p in range(start, end):
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        qlens.append(n)
        clens.append(end)
        tables.append(seq.block_table)
        if end == seq.num_tokens and seq.hidden is None:
            rows.append(len(ids) - 1)
    max_blocks = max((len(t) for t in tables), default=0)
    padded = [t + [-1] * (max_blocks - len(t)) for t in tables]

    def t(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    return StepPlan(
        kind=PlanKind.RUN,
        input_ids=t(ids),
        positions=t(pos).view(3, len(ids)),
        query_lens=t(qlens),
        context_lens=t(clens),
        slot_mapping=t(slots),
        block_tables=t(padded).view(len(tables), max_blocks),
        sample_rows=t(rows),
        media_index=torch.cat(media_index) if media_index else empty_int64(),
        media_modality=torch.cat(media_modality) if media_modality else empty_int64(),
        media_rows=torch.cat(media_rows) if media_rows else None,
        hidden_index=torch.cat(hidden_index) if hidden_index else empty_int64(),
    )
