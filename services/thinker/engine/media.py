"""Encoder rows of one prompt, kept with its request, and the share of them each step splices.

A multimodal request carries its encoder rows from submit to its end (host memory, the model's
dtype): the encoder's shared-memory lease lasts only seconds, while a request may be prefilled in
chunks and, after a preemption, prefilled again from the start. Rows sit in slot order, so the rows
of any token range [start, end) of the prompt are one contiguous slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptMedia:
    """The rows that replace placeholder embeddings in one prompt, with their positions and routers."""

    rows: torch.Tensor  # [M, H] in the model's dtype, host memory
    slots: torch.Tensor  # [M] int64 prompt positions, strictly increasing
    modality: torch.Tensor  # [M] int64 router codes (layers.moe VISION / AUDIO)

    def __post_init__(self) -> None:
        m = self.slots.numel()
        if (
            self.rows.dim() != 2
            or self.rows.shape[0] != m
            or self.modality.shape != (m,)
            or self.slots.dim() != 1
        ):
            raise ValueError(
                f"PromptMedia: rows {list(self.rows.shape)}, slots {list(self.slots.shape)} and "
                f"modality {list(self.modality.shape)} disagree"
            )
        if m > 1 and not bool((self.slots[1:] > self.slots[:-1]).all()):
            raise ValueError("PromptMedia: slots must be strictly increasing")

    @property
    def num_rows(self) -> int:
        return int(self.slots.numel())

    def span(self, start: int, end: int) -> tuple[int, int]:
        """[lo, hi): the rows whose slot lies in token range [start, end)."""
        return slot_span(self.slots, start, end)


def slot_span(slots: torch.Tensor, start: int, end: int) -> tuple[int, int]:
    """[lo, hi): the indices of the (increasing) `slots` that lie in token range [start, end)."""
    bounds = torch.searchsorted(slots, torch.tensor([start, end], dtype=slots.dtype))
    return int(bounds[0]), int(bounds[1])


@dataclass(frozen=True)
class MultimodalPrompt:
    """A prompt's token ids plus what a multimodal prompt adds: its encoder rows and 3D positions
    (and, for a hidden-state request, the slots whose final-norm hidden states it returns)."""

    token_ids: list[int]
    media: PromptMedia
    positions: torch.Tensor | None = None  # [3, P] video_rope positions; None: 1D (no vision item)
    rope_delta: int = 0  # decode positions = cache position + rope_delta (ming.md §2.3)
    hidden_slots: torch.Tensor | None = None  # [N] prompt positions (hidden-state mode); None: tokens

    def request_args(self) -> dict:
        """The keyword arguments of `LLMEngine.add_request` beyond the ids."""
        args = {"positions": self.positions, "rope_delta": self.rope_delta, "media": self.media}
        if self.hidden_slots is not None:
            args["hidden_slots"] = self.hidden_slots
        return args


Prompt = list[int] | MultimodalPrompt


def unpack_prompt(prompt: Prompt) -> tuple[list[int], dict]:
    """(token ids, add_request keyword arguments) of a plain or multimodal prompt."""
    if isinstance(prompt, MultimodalPrompt):
        return prompt.token_ids, prompt.request_args()
    return prompt, {}
