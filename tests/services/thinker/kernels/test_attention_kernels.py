"""Paged KV writes and paged decode attention in Triton (the write in its own launch or in the
decode launch) equal the reference; padding rows of a decode graph (slot -1, context 0) write
nothing and attend to nothing."""

from __future__ import annotations

import torch
from omnistage.services.thinker.kernels.paged_attention import paged_decode, write_kv
from omnistage.services.thinker.models.layers.attention import (
    AttentionMetadata,
    PagedAttention,
    attention_metadata,
)

HEADS, KV_HEADS, DIM, PAGE, BLOCKS = 8, 2, 32, 16, 40


def layer_with_cache(seed: int) -> PagedAttention:
    torch.manual_seed(seed)
    layer = PagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    layer.k_cache = torch.randn(BLOCKS, PAGE, KV_HEADS, DIM)
    layer.v_cache = torch.randn(BLOCKS, PAGE, KV_HEADS, DIM)
    return layer


def tables_for(contexts: list[int]) -> torch.Tensor:
    widest = max(-(-c // PAGE) for c in contexts)
    tables = torch.full((len(contexts), widest), -1, dtype=torch.int64)
    free = torch.randperm(BLOCKS).tolist()
    for b, c in enumerate(contexts):
        for i in range(-(-c // PAGE)):
            tables[b, i] = free.pop()
    return tables


def test_decode_attention_equals_the_reference_over_several_pages():
    layer = layer_with_cache(0)
    contexts = [5, 33, 16, 130]  # within one page, across pages, a full page, past one 64-token step
    tables = tables_for(contexts)
    slots = torch.tensor(
        [int(tables[b, (c - 1) // PAGE]) * PAGE + (c - 1) % PAGE for b, c in enumerate(contexts)]
    )
    q, k, v = torch.randn(4, HEADS, DIM), torch.randn(4, KV_HEADS, DIM), torch.randn(4, KV_HEADS, DIM)
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    with attention_metadata(AttentionMetadata([1] * 4, contexts, slots, tables)):
        want = layer(q, k, v)  # the reference writes the new K/V, then attends
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, layer.k_cache) and torch.equal(v_cache, layer.v_cache)
    got = paged_decode(q, k_cache, v_cache, tables, torch.tensor(contexts), layer.scale)
    assert ((got - want).norm() / want.norm()) < 1e-5


def test_decode_attention_writes_the_new_kv_itself_when_given_it():
    layer = layer_with_cache(2)
    contexts = [5, 33, 1]
    tables = tables_for(contexts)
    slots = [int(tables[b, (c - 1) // PAGE]) * PAGE + (c - 1) % PAGE for b, c in enumerate(contexts)]
    slots = torch.tensor(slots[:2] + [-1])  # the last row padding: writes nothing
    q, kv = torch.randn(3, HEADS, DIM), torch.randn(3, 2 * KV_HEADS, DIM)  # k, v: strided views
    k, v = kv[:, :KV_HEADS], kv[:, KV_HEADS:]
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slots)
    want = paged_decode(q, k_cache, v_cache, tables, torch.tensor(contexts), layer.scale)
    got = paged_decode(
        q, layer.k_cache, layer.v_cache, tables, torch.tensor(contexts), layer.scale, (k, v, slots)
    )
    assert torch.equal(layer.k_cache, k_cache) and torch.equal(layer.v_cache, v_cache)
    assert torch.allclose(got, want, atol=1e-6)


def test_padding_rows_write_nothing_and_attend_to_nothing():
    layer = layer_with_cache(1)
    before_k, before_v = layer.k_cache.clone(), layer.v_cache.clone()
    k, v = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    write_kv(k, v, layer.k_cache, layer.v_cache, torch.tensor([-1, 17, -1]))
    changed = (layer.k_cache != before_k).flatten(1).any(-1).nonzero().flatten().tolist()
    assert changed == [1]  # block 1 (slot 17 = block 1, offset 1) only
    assert torch.equal(layer.k_cache[1, 1], k[1]) and torch.equal(layer.v_cache[1, 1], v[1])
    assert torch.equal(layer.v_cache[0], before_v[0])
    out = paged_decode(
        torch.randn(2, HEADS, DIM),
        layer.k_cache,
        layer.v_cache,
        torch.zeros(2, 4, dtype=torch.int64),
        torch.tensor([0, 0]),
        layer.scale,
    )
    assert torch.equal(out, torch.zeros_like(out))
