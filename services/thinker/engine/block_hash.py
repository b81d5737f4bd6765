"""Content keys of full KV blocks, for prefix caching: equal keys mean equal K/V in every layer.

A block's K/V depend on everything before it, so its key is a hash chained over the previous
block's key and what the block itself holds: its token ids and, where the prompt is multimodal,
what replaces or moves those tokens — the bytes of the encoder rows spliced into its slots (with
their routers) and the 3D rope positions of its tokens. An image's blocks therefore match only for
the same image bytes at the same place. Anything else that would change the K/V (model, dtype, TP
layout) is fixed for the life of one engine, whose cache starts empty.

Keys are 16-byte BLAKE2b digests: made on rank 0 only (the decisions travel in the step plan as
block tables), stable across processes, and collision-free in practice.
"""

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
