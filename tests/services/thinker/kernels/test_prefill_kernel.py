"""The Triton paged prefill kernel equals the reference for every sequence of a step at once: prompt
chunks over a cached prefix, whole prompts, decode rows mixed in, GQA groups that need padding."""

from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.kernels.paged_attention import write_kv
from omnistage.services.thinker.kernels.paged_prefill import paged_prefill, prefill_tiles, tile_tokens
from omnistage.services.thinker.models.layers.attention import (
    AttentionMetadata,
    PagedAttention,
    attention_metadata,
)

PAGE, BLOCKS, DIM = 16, 64, 32


def cache_layer(heads: int, kv_heads: int, seed: int) -> PagedAttention:
    torch.manual_seed(seed)
    layer = PagedAttention(heads, kv_heads, DIM, DIM**-0.5)
    layer.k_cache = torch.randn(BLOCKS, PAGE, kv_heads, DIM)
    layer.v_cache = torch.randn(BLOCKS, PAGE, kv_heads, DIM)
    return layer


def step_layout(query_lens: list[int], context_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables (pages drawn at random, -1 padded) and the slots of each sequence's new tokens."""
    widest = max(-(-c // PAGE) for c in context_lens)
    tables = torch.full((len(context_lens), widest), -1, dtype=torch.int64)
    free = torch.randperm(BLOCKS).tolist()
    slots = []
    for i, (q, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        for j in range(-(-c // PAGE)):
            tables[i, j] = free.pop()
        slots += [int(tables[i, p // PAGE]) * PAGE + p % PAGE for p in range(c - q, c)]
    return tables, torch.tensor(slots, dtype=torch.int64)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "query_lens", "context_lens"),
    [
        (8, 2, [37], [37]),  # one whole prompt, several tiles and pages
        (8, 2, [5, 40, 1, 1], [70, 40, 9, 130]),  # a chunk over a cached prefix, a prompt, two decodes
        (6, 2, [17, 1], [17, 33]),  # a GQA group of 3 (padded to 4)
        (4, 4, [3, 64], [19, 200]),  # no GQA, a chunk that ends past several key blocks
    ],
    ids=["one-prompt", "mixed", "group-3", "mha"],
)
def test_prefill_kernel_equals_the_reference(heads, kv_heads, query_lens, context_lens):
    layer = cache_layer(heads, kv_heads, seed=sum(context_lens))
    tables, slots = step_layout(query_lens, context_lens)
    t = sum(query_lens)
    q, k, v = torch.randn(t, heads, DIM), torch.randn(t, kv_heads, DIM), torch.randn(t, kv_heads, DIM)
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    with attention_metadata(AttentionMetadata(query_lens, context_lens, slots, tables)):
        want = layer(q, k, v)  # the reference: writes the new K/V, then each sequence on its own
    write_kv(k, v, k_cache, v_cache, slots)
    tiles = prefill_tiles(query_lens, context_lens, tile_tokens(heads, kv_heads))
    got = paged_prefill(q, k_cache, v_cache, tables, tiles, layer.scale)
    assert ((got - want).norm() / want.norm()) < 1e-5


def test_the_tile_table_covers_every_token_once():
    tiles = prefill_tiles([5, 0, 20, 1], [30, 4, 20, 7], block_q=8)
    assert tiles.tolist() == [
        [0, 0, 5, 25, 30],  # sequence 0: 5 tokens at positions 25..29
        [2, 5, 8, 0, 20],  # sequence 1 has no new token: no tile
        [2, 13, 8, 8, 20],
        [2, 21, 4, 16, 20],
        [3, 25, 1, 6, 7],  # a decode row
    ]
    assert tile_tokens(32, 4) == 8 and tile_tokens(6, 2) == 16 and tile_tokens(4, 4) == 64
