"""A decode step's QK-norm + rope folded into the decode attention launch (`paged_decode(...,
qk_rope=...)`) equals the separate launches (`qk_norm_rope` in place, then `paged_decode`) bit for
bit — the attention output and the cache it leaves (the new K roped) — and the reference within
fp32 rounding; and the attention layer's Triton backend folds it in a decode step with the fusions
on only (a prefill step, and the fusions off, launch `_qk_norm_rope_kernel`)."""

from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.kernels import norms, paged_attention
from omnistage.services.thinker.kernels.norms import qk_norm_rope
from omnistage.services.thinker.kernels.paged_attention import paged_decode
from omnistage.services.thinker.models.layers.attention import (
    AttentionMetadata,
    PagedAttention,
    QKNormRope,
    attention_metadata,
)
from omnistage.services.thinker.models.layers.backends import TritonAttention
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding

PAGE = 16
# Longer than a split's 128 tokens (the merge runs with splits > 1), one split's worth and two
# tokens more, a short one, the new token alone, and a padding row of a decode graph (slot -1).
CONTEXTS = [300, 130, 5, 1, 0]


class Case:
    """One decode step of len(contexts) sequences: random caches, block tables, the new tokens'
    raw q / k / v as views of their qkv rows, the QK-norm weights and the rope of their positions."""

    def __init__(self, heads, kv_heads, dim, rot, norm, dtype, contexts=CONTEXTS, seed=0):
        torch.manual_seed(seed)
        pages = [max(1, -(-c // PAGE)) for c in contexts]
        blocks = sum(pages) + 3
        self.k_cache, self.v_cache = torch.randn(2, blocks, PAGE, kv_heads, dim).to(dtype).unbind(0)
        free = torch.randperm(blocks).tolist()
        self.tables = torch.full((len(contexts), max(pages)), -1, dtype=torch.int64)
        for b, n in enumerate(pages):
            self.tables[b, :n] = torch.tensor([free.pop() for _ in range(n)])
        self.contexts, self.lens = contexts, torch.tensor(contexts)
        last = [int(self.tables[b, (c - 1) // PAGE]) * PAGE + (c - 1) % PAGE for b, c in enumerate(contexts)]
        self.slots = torch.tensor([s if c > 0 else -1 for s, c in zip(last, contexts, strict=True)])
        qkv = torch.randn(len(contexts), (heads + 2 * kv_heads) * dim).to(dtype)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        self.q, self.k, self.v = q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
        weights = [torch.randn(dim).to(dtype) for _ in range(2)] if norm else [None, None]
        positions = torch.tensor([max(c - 1, 0) for c in contexts])
        cos, sin = RotaryEmbedding(dim, rot, 10000.0, "default").cos_sin(positions, dtype)
        self.qk_rope = QKNormRope(*weights, 1e-6, cos, sin)
        self.scale = dim**-0.5

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()

    def separate(self, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The unfused launches: QK-norm + rope in place on copies of q and k, then the attention."""
        (k_cache, v_cache), q, k = self.caches(), self.q.clone(), self.k.clone()
        qk_norm_rope(q, k, *self.qk_rope)
        out = paged_decode(
            q, k_cache, v_cache, self.tables, self.lens, self.scale, (k, self.v, self.slots), splits
        )
        return out, k_cache, v_cache

    def fused(self, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self.caches()
        new_kv = (self.k, self.v, self.slots)
        out = paged_decode(
            self.q, k_cache, v_cache, self.tables, self.lens, self.scale, new_kv, splits, self.qk_rope
        )
        return out, k_cache, v_cache

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The torch reference layer (QKNormRope.reference, index_copy_, fp32 attention) on the rows
        that are not padding."""
        rows = [b for b, c in enumerate(self.contexts) if c > 0]
        layer = PagedAttention(self.q.shape[1], self.k.shape[1], self.q.shape[2], self.scale)
        layer.k_cache, layer.v_cache = self.caches()
        qk_rope = self.qk_rope._replace(cos=self.qk_rope.cos[rows], sin=self.qk_rope.sin[rows])
        md = AttentionMetadata(
            [1] * len(rows), [self.contexts[b] for b in rows], self.slots[rows], self.tables[rows]
        )
        with attention_metadata(md):
            out = layer(self.q[rows], self.k[rows], self.v[rows], qk_rope)
        return out, layer.k_cache, layer.v_cache


SHAPES = {  # (query heads, KV heads, head dim, rotary dim, QK norm)
    "gqa4-partial-rope-norm": (8, 2, 32, 16, True),
    "gqa4-full-rope-no-norm": (8, 2, 32, 32, False),
    "gqa6-partial-rope-norm": (12, 2, 64, 32, True),  # a group padded to 16 rows
}


@pytest.mark.parametrize("splits", [1, 4, 16], ids=["whole-context", "four-splits", "sixteen-splits"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_the_folded_qk_norm_rope_equals_the_separate_launch_bit_for_bit(shape, dtype, splits):
    case = Case(*shape, dtype)
    raw_q, raw_k = case.q.clone(), case.k.clone()
    got, got_k_cache, got_v_cache = case.fused(splits)
    want, want_k_cache, want_v_cache = case.separate(splits)
    assert torch.equal(got, want)
    assert torch.equal(got_k_cache, want_k_cache) and torch.equal(got_v_cache, want_v_cache)
    assert not torch.equal(got_k_cache, case.k_cache)  # the new rows were written (roped)
    assert torch.equal(case.q, raw_q) and torch.equal(case.k, raw_k)  # q and k left raw in memory
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # the padding row: nothing written or read
    if dtype == torch.float32:
        ref, ref_k_cache, ref_v_cache = case.reference()
        assert ((got[:-1] - ref).norm() / ref.norm()) < 1e-5
        assert torch.allclose(got_k_cache, ref_k_cache, atol=1e-5) and torch.equal(got_v_cache, ref_v_cache)


def test_folding_needs_the_new_kv():
    case = Case(8, 2, 32, 16, True, torch.float32, contexts=[3])
    with pytest.raises(ValueError, match="qk_rope needs new_kv"):
        paged_decode(
            case.q, case.k_cache, case.v_cache, case.tables, case.lens, case.scale, qk_rope=case.qk_rope
        )


@pytest.fixture
def attention_launches(launches):
    """The launches of a layer's attention kernels but the prefill one (conftest's `launches`)."""
    launches.watch(norms, "_qk_norm_rope_kernel")
    launches.watch(paged_attention, "_write_kv_kernel")
    launches.watch(paged_attention, "_decode_kernel")
    return launches


@pytest.mark.parametrize("fuse", [True, False], ids=["fusions-on", "fusions-off"])
def test_a_decode_step_folds_qk_norm_rope_into_its_attention_launch_with_the_fusions_on(
    fuse, attention_launches
):
    case = Case(8, 2, 32, 16, True, torch.float32, contexts=[40, 7])
    want, want_k_cache, _ = case.reference()
    layer = PagedAttention(8, 2, 32, case.scale)
    layer.k_cache, layer.v_cache = case.caches()
    layer.backend = TritonAttention(fuse)
    md = AttentionMetadata([1, 1], case.contexts, case.slots, case.tables, context_lens_tensor=case.lens)
    with attention_metadata(md):
        got = layer(case.q.clone(), case.k.clone(), case.v, case.qk_rope)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(layer.k_cache, want_k_cache, atol=1e-5)
    if fuse:  # one launch: the attention writes the new K/V and norms and ropes q and K itself
        assert attention_launches.log == [("_decode_kernel", (2, 2, 1), 16)]
    else:  # the same build's unfused comparison: three (the decode launch without the rope: ROT 0)
        assert attention_launches.log == [
            ("_qk_norm_rope_kernel", (2, 8 + 2), 16),
            ("_write_kv_kernel", (2,), None),
            ("_decode_kernel", (2, 2, 1), 0),
        ]


def test_a_prefill_step_keeps_the_separate_qk_norm_rope_launch(attention_launches):
    torch.manual_seed(5)
    layer = PagedAttention(8, 2, 32, 32**-0.5)
    layer.k_cache, layer.v_cache = torch.randn(2, 8, PAGE, 2, 32).unbind(0)
    reference = PagedAttention(8, 2, 32, 32**-0.5)
    reference.k_cache, reference.v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    layer.backend = TritonAttention(fuse=True)
    q, k, v = torch.randn(5, 8, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    cos, sin = RotaryEmbedding(32, 16, 10000.0, "default").cos_sin(torch.arange(5), torch.float32)
    qk_rope = QKNormRope(torch.randn(32), torch.randn(32), 1e-6, cos, sin)
    md = AttentionMetadata([5], [5], torch.arange(5) + 16, torch.tensor([[1, -1]]))
    with attention_metadata(md):
        want = reference(q, k, v, qk_rope)
    with attention_metadata(md):
        got = layer(q.clone(), k.clone(), v, qk_rope)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(
        layer.k_cache, reference.k_cache, atol=1e-5
    )
    assert attention_launches.names() == ["_qk_norm_rope_kernel", "_write_kv_kernel"]  # then the prefill


def test_the_fold_is_taken_where_each_sequence_runs_in_few_splits():
    """Measured on an H200: folded QK-norm + rope pays at 8 splits a (sequence, KV head), loses at 16
    (every split norms its query heads again); under the interpreter one split: always folded."""
    from omnistage.services.thinker.kernels.paged_attention import QK_FOLD_MAX_SPLITS, folds_qk_rope

    assert QK_FOLD_MAX_SPLITS == 8
    assert not folds_qk_rope(1, 4, on_gpu=True)  # Ling-mini, one sequence: 16 splits
    assert not folds_qk_rope(2, 4, on_gpu=True)
    assert folds_qk_rope(4, 4, on_gpu=True)  # 8 splits
    assert folds_qk_rope(8, 2, on_gpu=True) and folds_qk_rope(64, 4, on_gpu=True)
    assert folds_qk_rope(1, 4, on_gpu=False)
