"""Paged KV writes and paged decode attention in Triton (the write in its own launch or in the
decode launch) equal the reference; padding rows of a decode graph (slot -1, context 0) write
nothing and attend to nothing."""

from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.kernels.paged_attention import (
    MAX_SPLITS,
    SPLIT_TARGET_PROGRAMS,
    decode_splits,
    paged_decode,
    write_kv,
)
from omnistage.services.thinker.kernels.tickets import tickets_for
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


def reference_decode(q, k_cache, v_cache, tables, contexts, scale) -> torch.Tensor:
    """Each sequence's heads over its context's rows gathered through its table, in fp64."""
    heads, kv_heads, page = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    for b, c in enumerate(contexts):
        pos = torch.arange(c)
        blocks = tables[b, pos // page]
        k = k_cache[blocks, pos % page].double().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[blocks, pos % page].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].double() * scale, k)
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (12, 2)], ids=["gqa-4", "gqa-6"])
def test_the_context_split_decode_equals_the_whole_context_one(heads, kv_heads):
    """Flash-decoding in one launch: each (sequence, KV head) over context splits, the last split
    to finish merging them; splits past a short context do nothing; the tickets left zero."""
    torch.manual_seed(heads)
    contexts = [1, 15, 64, 200, 1000]
    blocks = sum(-(-c // PAGE) for c in contexts) + 2
    k_cache, v_cache = torch.randn(2, blocks, PAGE, kv_heads, DIM).unbind(0)
    widest = max(-(-c // PAGE) for c in contexts)
    tables, free = torch.zeros(len(contexts), widest, dtype=torch.int64), torch.randperm(blocks).tolist()
    for b, c in enumerate(contexts):
        tables[b, : -(-c // PAGE)] = torch.tensor([free.pop() for _ in range(-(-c // PAGE))])
    q, lens = torch.randn(len(contexts), heads, DIM), torch.tensor(contexts)
    want = reference_decode(q, k_cache, v_cache, tables, contexts, DIM**-0.5)
    whole = paged_decode(q, k_cache, v_cache, tables, lens, DIM**-0.5, splits=1)
    assert ((whole - want).norm() / want.norm()) < 1e-5
    for splits in (3, 16):
        got = paged_decode(q, k_cache, v_cache, tables, lens, DIM**-0.5, splits=splits)
        assert torch.allclose(got, whole, atol=1e-5), splits
    assert not tickets_for(q.device, 1).any()


def test_the_split_holding_the_new_token_writes_its_kv():
    layer = layer_with_cache(4)
    contexts = [200, 1, 70, 0]  # the last row padding: slot -1, nothing read
    tables = tables_for([max(c, 1) for c in contexts])
    slots = [int(tables[b, (c - 1) // PAGE]) * PAGE + (c - 1) % PAGE for b, c in enumerate(contexts)]
    slots = torch.tensor(slots[:3] + [-1])
    q, k, v = torch.randn(4, HEADS, DIM), torch.randn(4, KV_HEADS, DIM), torch.randn(4, KV_HEADS, DIM)
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slots)
    want = paged_decode(q, k_cache, v_cache, tables, torch.tensor(contexts), layer.scale, splits=1)
    got = paged_decode(
        q, layer.k_cache, layer.v_cache, tables, torch.tensor(contexts), layer.scale, (k, v, slots), 8
    )
    assert torch.equal(layer.k_cache, k_cache) and torch.equal(layer.v_cache, v_cache)
    assert torch.allclose(got, want, atol=1e-5) and torch.equal(got[3], torch.zeros_like(got[3]))


def test_small_decode_grids_split_over_the_context_and_large_ones_do_not():
    assert decode_splits(1, 4) == MAX_SPLITS  # Ling-mini at c=1: 4 programs
    assert decode_splits(8, 4) == SPLIT_TARGET_PROGRAMS // 32
    assert decode_splits(64, 4) == 1
