"""The paged prefill kernel's tile table, made on the host (no Triton here: the engine's prefill graphs
stage it without importing a kernel module)."""

from __future__ import annotations

TILE_FIELDS = 5  # sequence, first flattened token row, tokens (1..block_q), first token's position, context


def prefill_tile_rows(query_lens: list[int], context_lens: list[int], block_q: int) -> list[int]:
    """Every sequence of a step cut into tiles of `block_q` query tokens, flattened: per tile its
    sequence, first flattened token row, tokens, the cache position of its first token and the
    sequence's context length (new tokens included)."""
    rows: list[int] = []
    start = 0
    for seq, (qlen, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        for t0 in range(0, qlen, block_q):
            rows += (seq, start + t0, min(block_q, qlen - t0), ctx - qlen + t0, ctx)
        start += qlen
    return rows
