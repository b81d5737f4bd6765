"""Paged KV writes and paged decode attention in Triton (the write in its own launch or in the
decode launch) equal the reference; padding rows of a decode graph (slot -1, context 0) write
nothing and attend to nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnistage.services.thinker.kernels import paged_attention
from omnistage.services.thinker.kernels.paged_attention import (
    MAX_SPLITS,
    SPLIT_MIN_TOKENS,
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


# Within one split, one split's worth, one token past it, several splits, and a padding row of a
# decode graph (context 0, slot -1), in one launch.
SPLIT_CONTEXTS = [1, 5, 127, 128, 129, 300, 1000, 0]
BLOCK_N = 64  # paged_decode's step at pages of 16 tokens


def held_splits(ctx: int, splits: int) -> int:
    """How many of `splits` hold a token of a context of `ctx` (its chunk: whole BLOCK_N steps of
    at least SPLIT_MIN_TOKENS); the rest are empty."""
    chunk = max(cdiv(cdiv(ctx, splits), BLOCK_N) * BLOCK_N, SPLIT_MIN_TOKENS)
    return cdiv(ctx, chunk)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SplitCase:
    """A decode launch of SPLIT_CONTEXTS: caches, block tables, q and the new tokens' K/V and slots."""

    def __init__(self, heads: int, kv_heads: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.contexts, self.group = SPLIT_CONTEXTS, heads // kv_heads
        pages = [max(1, -(-c // PAGE)) for c in self.contexts]
        blocks = sum(pages) + 2
        self.k_cache, self.v_cache = torch.randn(2, blocks, PAGE, kv_heads, DIM).unbind(0)
        free = torch.randperm(blocks).tolist()
        self.tables = torch.full((len(pages), max(pages)), -1, dtype=torch.int64)
        for b, n in enumerate(pages):
            self.tables[b, :n] = torch.tensor([free.pop() for _ in range(n)])
        last = [
            int(self.tables[b, (c - 1) // PAGE]) * PAGE + (c - 1) % PAGE for b, c in enumerate(self.contexts)
        ]
        self.slots = torch.tensor([s if c > 0 else -1 for s, c in zip(last, self.contexts, strict=True)])
        self.lens = torch.tensor(self.contexts)
        self.q = torch.randn(len(pages), heads, DIM)
        self.k, self.v = torch.randn(2, len(pages), kv_heads, DIM).unbind(0)

    def decode(self, splits: int, write_kv: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        new_kv = (self.k, self.v, self.slots) if write_kv else None
        out = paged_decode(self.q, k_cache, v_cache, self.tables, self.lens, DIM**-0.5, new_kv, splits)
        return out, k_cache, v_cache


@pytest.fixture
def poisoned_states(monkeypatch):
    """The split launches' state buffers filled with NaN (a NaN read reaches the output), each
    launch's (part, stats) kept in `launches`."""
    launches = []
    made = paged_attention.split_states

    def poisoned(q, seqs_heads, splits, rows):
        part, stats, tickets = made(q, seqs_heads, splits, rows)
        if splits > 1:
            launches.append((part.fill_(float("nan")), stats.fill_(float("nan"))))
        return part, stats, tickets

    monkeypatch.setattr(paged_attention, "split_states", poisoned)
    return launches


def merged(stats: torch.Tensor, part: torch.Tensor, splits: int) -> torch.Tensor:
    """The merge of `splits` states (stats [splits, 2, rows], part [splits, rows, D]) in split
    order, in fp32 as the kernel's arithmetic (the interpreter's: numpy); past the stored ones an
    empty split's state (-inf, 0, 0), as the merge of every split used to read."""
    held, rows = stats.shape[0], stats.shape[2]
    m = np.full((splits, rows), -np.inf, np.float32)
    s = np.zeros((splits, rows), np.float32)
    p = np.zeros((splits, rows, part.shape[2]), np.float32)
    m[:held], s[:held], p[:held] = stats[:, 0].numpy(), stats[:, 1].numpy(), part.numpy()
    top = m.max(axis=0)
    top = np.where(top == -np.inf, np.float32(0), top)
    total, out = np.zeros(rows, np.float32), np.zeros(p.shape[1:], np.float32)
    for i in range(splits):
        w = np.exp(m[i] - top)
        total = total + w * s[i]
        out = out + w[:, None] * p[i]
    return torch.from_numpy(out / np.maximum(total, np.float32(1e-30))[:, None])


@pytest.mark.parametrize("splits", [2, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (12, 2)], ids=["gqa-4", "gqa-6"])
def test_the_split_merge_reads_and_writes_only_the_splits_and_rows_that_hold_tokens(
    heads, kv_heads, splits, poisoned_states
):
    """Each (sequence, KV head)'s splits past its context store no state and take no part in the
    merge, nor do the padding rows of the GQA group (GROUP_PAD 16): the state buffers, NaN before
    the launch, keep NaN there, and no NaN reaches the output. The merge of the stored states is
    their sum in split order, bit for bit — and so the same as the merge of every split with the
    empty ones' (-inf, 0, 0), the launch before the merge skipped them; a context within one split
    (split 0 alone) is the unsplit launch's bit for bit, and every output the reference's."""
    case = SplitCase(heads, kv_heads)
    whole, _, _ = case.decode(1)
    assert not poisoned_states  # one split: no states
    got, _, _ = case.decode(splits)
    (part, stats), group = poisoned_states[0], case.group
    part = part.view(len(case.contexts), kv_heads, splits, *part.shape[1:])
    stats = stats.view(len(case.contexts), kv_heads, splits, *stats.shape[1:])
    assert not got.isnan().any()
    for b, ctx in enumerate(case.contexts):
        held = held_splits(ctx, splits)
        merges = held >= 2
        for kvh in range(kv_heads):
            heads_of = slice(kvh * group, (kvh + 1) * group)
            want = torch.zeros(splits, part.shape[-2], dtype=torch.bool)  # [splits, GROUP_PAD] rows
            want[:held, :group] = merges
            for nan in (part[b, kvh].isnan(), stats[b, kvh].transpose(1, 2).isnan()):
                assert torch.equal(~nan.any(-1), want) and torch.equal(nan.all(-1), ~want), (ctx, kvh)
            if merges:
                state = stats[b, kvh, :held, :, :group], part[b, kvh, :held, :group]
                assert torch.equal(got[b, heads_of], merged(*state, held)), (ctx, kvh)
                assert torch.equal(got[b, heads_of], merged(*state, splits)), (ctx, kvh)
            else:  # split 0 alone: the unsplit launch's arithmetic
                assert torch.equal(got[b, heads_of], whole[b, heads_of]), (ctx, kvh)
    live = [b for b, c in enumerate(case.contexts) if c > 0]
    want = reference_decode(
        case.q[live],
        case.k_cache,
        case.v_cache,
        case.tables[live],
        [case.contexts[b] for b in live],
        DIM**-0.5,
    )
    assert torch.allclose(got[live], want, atol=1e-5) and torch.allclose(got, whole, atol=1e-5)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # the padding row
    assert not tickets_for(got.device, 1).any()  # every ticket taken was reset


@pytest.mark.parametrize("splits", [2, 4, 16])
def test_the_split_launch_writes_the_new_kv_as_the_unsplit_one(splits):
    """With `new_kv` the split holding the last token (split 0 of a context within one, nothing for
    the padding row) writes it: the caches as the unsplit launch leaves them, and the outputs of the
    contexts within one split the same bits."""
    case = SplitCase(12, 2, seed=3)
    whole, whole_k, whole_v = case.decode(1, write_kv=True)
    got, got_k, got_v = case.decode(splits, write_kv=True)
    assert torch.equal(got_k, whole_k) and torch.equal(got_v, whole_v)
    assert not torch.equal(got_k, case.k_cache)  # the new rows were written
    alone = [b for b, c in enumerate(case.contexts) if held_splits(c, splits) <= 1]
    assert torch.equal(got[alone], whole[alone]) and torch.allclose(got, whole, atol=1e-5)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
