"""StepPlan: everything a rank needs to run one forward, as int64 tensors that pack into one buffer."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class PlanKind(enum.IntEnum):
    NOOP = 0  # keep-alive while rank 0 is idle: workers go back to waiting
    RUN = 1
    EXIT = 2


# What the first int64s of an encoded plan say (the arrays' sizes follow from them).
_HEADER = (
    "kind",
    "num_seqs",
    "num_tokens",
    "num_sample_rows",
    "max_blocks",
    "num_media_rows",
    "share_sampled",
    "num_hidden_rows",
)


def empty_int64() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)


@dataclass
class StepPlan:
    """One step, sequences in batch order; tokens are flattened sequence by sequence. An input id
    below 0 is a placeholder: the id the previous step sampled at row -id - 1, which every rank holds
    on its device (`share_sampled` of that step's plan; engine/sampled_feed.py)."""

    kind: PlanKind = PlanKind.RUN
    input_ids: torch.Tensor = field(default_factory=empty_int64)  # [T]
    positions: torch.Tensor = field(default_factory=lambda: torch.zeros(3, 0, dtype=torch.int64))  # [3, T]
    query_lens: torch.Tensor = field(default_factory=empty_int64)  # [S] new tokens per sequence
    context_lens: torch.Tensor = field(default_factory=empty_int64)  # [S] cached tokens after this step
    slot_mapping: torch.Tensor = field(default_factory=empty_int64)  # [T] cache slot per new token
    block_tables: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int64))  # [S, B]
    sample_rows: torch.Tensor = field(default_factory=empty_int64)  # [R] token rows whose logits are needed
    media_index: torch.Tensor = field(default_factory=empty_int64)  # [M] token rows that take an encoder row
    media_modality: torch.Tensor = field(default_factory=empty_int64)  # [M] their router codes (layers.moe)
    # [M, H] the encoder rows, in media_index order: rank 0 only, never encoded (see the module docstring).
    media_rows: torch.Tensor | None = None
    # [K] token rows whose final-norm hidden states hidden-state requests keep, in batch order. Every rank
    # gets it, so a rule that reads it (which steps a graph covers) decides alike on every rank; rank 0
    # alone gathers the rows.
    hidden_index: torch.Tensor = field(default_factory=empty_int64)
    # Rank 0 broadcasts this step's sampled ids to every rank's device after the step: the next plan
    # may name them by placeholders (async scheduling).
    share_sampled: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_sample_rows(self) -> int:
        return int(self.sample_rows.numel())

    @property
    def has_placeholders(self) -> bool:
        """Some input ids are the previous step's sampled ids, still on the device."""
        return bool(self.num_tokens) and int(self.input_ids.min()) < 0

    @property
    def num_media_rows(self) -> int:
        return int(self.media_index.numel())

    @classmethod
    def exit(cls) -> StepPlan:
        return cls(kind=PlanKind.EXIT)

    @classmethod
    def noop(cls) -> StepPlan:
        return cls(kind=PlanKind.NOOP)

    def encode(self) -> torch.Tensor:
        """Pack into one int64 tensor: header [kind, S, T, R, B, M, share, K] then the arrays (not media_rows)."""
        num_seqs, max_blocks = self.block_tables.shape if self.block_tables.dim() == 2 else (0, 0)
        header = torch.tensor(
            [
                int(self.kind),
                num_seqs,
                self.num_tokens,
                self.sample_rows.numel(),
                max_blocks,
                self.num_media_rows,
                int(self.share_sampled),
                self.hidden_index.numel(),
            ],
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
            self.media_index,
            self.media_modality,
            self.hidden_index,
        ]
        return torch.cat([p.to(torch.int64) for p in parts])

    @classmethod
    def decode(cls, buf: torch.Tensor) -> StepPlan:
        head = len(_HEADER)
        kind, num_seqs, num_tokens, num_rows, max_blocks, num_media, share, num_hidden = (
            int(x) for x in buf[:head].tolist()
        )
        sizes = [
            num_tokens,
            3 * num_tokens,
            num_seqs,
            num_seqs,
            num_tokens,
            num_rows,
            num_seqs * max_blocks,
            num_media,
            num_media,
            num_hidden,
        ]
        if buf.numel() != head + sum(sizes):
            raise ValueError(f"step plan: buffer of {buf.numel()} int64s, header says {head + sum(sizes)}")
        ids, pos, qlens, clens, slots, rows, tables, media_index, media_modality, hidden_index = torch.split(
            buf[head:], sizes
        )
        return cls(
            kind=PlanKind(kind),
            input_ids=ids,
            positions=pos.view(3, num_tokens),
            query_lens=qlens,
            context_lens=clens,
            slot_mapping=slots,
            block_tables=tables.view(num_seqs, max_blocks),
            sample_rows=rows,
            media_index=media_index,
            media_modality=media_modality,
            hidden_index=hidden_index,
            share_sampled=bool(share),
        )
