"""StepPlan: everything a rank needs to run one forward, as int64 tensors that pack into one buffer.

Rank 0 decides; ranks 1..N-1 execute what the plan says and nothing else, so ranks cannot diverge.
The plan is flat integers (no pickled engine objects), a few hundred int64s in decode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from omnistage.services.thinker.engine.sequence import Sequence


class PlanKind(enum.IntEnum):
    NOOP = 0  # keep-alive while rank 0 is idle: workers go back to waiting
    RUN = 1
    EXIT = 2


def _empty() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)


@dataclass
class StepPlan:
    """One step, sequences in batch order; tokens are flattened sequence by sequence."""

    kind: PlanKind = PlanKind.RUN
    input_ids: torch.Tensor = field(default_factory=_empty)  # [T]
    positions: torch.Tensor = field(default_factory=lambda: torch.zeros(3, 0, dtype=torch.int64))  # [3, T]
    query_lens: torch.Tensor = field(default_factory=_empty)  # [S] new tokens per sequence
    context_lens: torch.Tensor = field(default_factory=_empty)  # [S] cached tokens after this step
    slot_mapping: torch.Tensor = field(default_factory=_empty)  # [T] cache slot per new token
    block_tables: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int64))  # [S, B]
    sample_rows: torch.Tensor = field(default_factory=_empty)  # [R] token rows whose logits are needed

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @classmethod
    def exit(cls) -> StepPlan:
        return cls(kind=PlanKind.EXIT)

    @classmethod
    def noop(cls) -> StepPlan:
        return cls(kind=PlanKind.NOOP)

    def encode(self) -> torch.Tensor:
        """Pack into one int64 tensor: header [kind, S, T, R, B] then the arrays."""
        num_seqs, max_blocks = self.block_tables.shape if self.block_tables.dim() == 2 else (0, 0)
        header = torch.tensor(
            [int(self.kind), num_seqs, self.num_tokens, self.sample_rows.numel(), max_blocks],
            dtype=torch.int64,
        )
        parts = [
            header,
            self.input_ids,
            self.positions.flatten(),
            self.query_lens,
            self.context_lens,
            self.slot_mapping,
            self.sample_rows,
            self.block_tables.flatten(),
        ]
        return torch.cat([p.to(torch.int64) for p in parts])

    @classmethod
    def decode(cls, buf: torch.Tensor) -> StepPlan:
        kind, num_seqs, num_tokens, num_rows, max_blocks = (int(x) for x in buf[:5].tolist())
        sizes = [num_tokens, 3 * num_tokens, num_seqs, num_seqs, num_tokens, num_rows, num_seqs * max_blocks]
        if buf.numel() != 5 + sum(sizes):
            raise ValueError(f"step plan: buffer of {buf.numel()} int64s, header says {5 + sum(sizes)}")
        ids, pos, qlens, clens, slots, rows, tables = torch.split(buf[5:], sizes)
        return cls(
            kind=PlanKind(kind),
            input_ids=ids,
            positions=pos.view(3, num_tokens),
            query_lens=qlens,
            context_lens=clens,
            slot_mapping=slots,
            block_tables=tables.view(num_seqs, max_blocks),
            sample_rows=rows,
        )


def build_step_plan(scheduled: list[tuple[Sequence, int]], block_size: int) -> StepPlan:
    """Plan for sequences each computing its next `n` uncomputed tokens; rows sample where a sequence
    reaches its last known token (prefill finished or decode)."""
    ids: list[int] = []
    pos: list[list[int]] = [[], [], []]
    qlens, clens, slots, rows, tables = [], [], [], [], []
    for seq, n in scheduled:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        ids.extend(seq.token_ids[start:end])
        for axis, row in enumerate(seq.positions(start, end)):
            pos[axis].extend(row)
        for p in range(start, end):
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        qlens.append(n)
        clens.append(end)
        tables.append(seq.block_table)
        if end == seq.num_tokens:
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
    )
