"""Content keys of full KV blocks, for prefix caching: equal keys mean equal K/V in every layer."""

from __future__ import annotations

import hashlib
import struct
from typing import Protocol

import torch
from omnistage.services.thinker.engine.media import PromptMedia

BlockKey = bytes
_ROOT = b"omnistage-kv-v1"


class KeyedTokens(Protocol):
    """What a block's key is made of (sequence.Sequence)."""

    token_ids: list[int]
    num_prompt_tokens: int
    media: PromptMedia | None
    prompt_positions: torch.Tensor | None
    rope_delta: int

    def positions(self, start: int, end: int) -> list[list[int]]: ...


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a host tensor (any dtype, bfloat16 included)."""
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def block_key(seq: KeyedTokens, index: int, block_size: int, parent: BlockKey | None) -> BlockKey:
    """Key of block `index` of `seq` (its tokens must all be known), chained on `parent`'s key."""
    start, end = index * block_size, (index + 1) * block_size
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(struct.pack(f"<{block_size}q", *seq.token_ids[start:end]))
    media = seq.media
    if media is not None and start < seq.num_prompt_tokens:
        lo, hi = media.span(start, end)
        if hi > lo:
            h.update(b"media")
            h.update(_tensor_bytes(media.slots[lo:hi].to(torch.int64)))
            h.update(_tensor_bytes(media.modality[lo:hi].to(torch.int64)))
            h.update(_tensor_bytes(media.rows[lo:hi]))
    if seq.prompt_positions is not None or seq.rope_delta:
        h.update(b"pos")
        h.update(struct.pack(f"<{3 * block_size}q", *(p for axis in seq.positions(start, end) for p in axis)))
    return h.digest()
