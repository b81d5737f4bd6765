"""RMSNorm (+ residual add), QK-norm + rope, SiLU·mul and the grouped top-k router in Triton
equal the reference modules."""

from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.kernels.norms import qk_norm_rope, rms_norm, silu_and_mul
from omnistage.services.thinker.kernels.router import grouped_topk_route
from omnistage.services.thinker.models.layers.moe import Router
from omnistage.services.thinker.models.layers.norm import RMSNorm
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding


def test_rms_norm_with_and_without_the_residual_add():
    torch.manual_seed(0)
    norm = RMSNorm(96)
    norm.weight.data.normal_()
    x, residual = torch.randn(5, 96), torch.randn(5, 96)
    with torch.no_grad():
        assert torch.allclose(rms_norm(x, norm.weight, norm.eps), norm(x), atol=1e-6)
        got, got_sum = rms_norm(x, norm.weight, norm.eps, residual)
        want, want_sum = norm(x, residual)
    assert torch.allclose(got, want, atol=1e-6) and torch.equal(got_sum, want_sum)


@pytest.mark.parametrize("dim,rotary_dim,rope_type", [(32, 16, "default"), (128, 64, "video_rope")])
def test_qk_norm_and_partial_rope_in_place_on_the_qkv_rows(dim, rotary_dim, rope_type):
    torch.manual_seed(1)
    tokens, q_heads, kv_heads = 4, 4, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim)
    q_norm, k_norm = RMSNorm(dim), RMSNorm(dim)
    q_norm.weight.data.normal_()
    k_norm.weight.data.normal_()
    rope = RotaryEmbedding(dim, rotary_dim, 10000.0, rope_type)
    positions = torch.stack(
        [torch.arange(tokens), torch.arange(tokens) * 2, torch.arange(tokens) + 5]
    )  # t, h, w
    cos, sin = rope.cos_sin(positions, torch.float32)
    q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    with torch.no_grad():
        want_q, want_k = rope.apply(
            cos, sin, q_norm(q.view(tokens, q_heads, dim)), k_norm(k.view(tokens, kv_heads, dim))
        )
        rows = qkv.clone()
        qk = rows[:, : (q_heads + kv_heads) * dim].view(tokens, -1, dim)
        qk_norm_rope(qk, q_heads, q_norm.weight, k_norm.weight, 1e-6, cos, sin)
    assert torch.allclose(qk[:, :q_heads], want_q, atol=1e-5)
    assert torch.allclose(qk[:, q_heads:], want_k, atol=1e-5)
    assert torch.equal(rows[:, (q_heads + kv_heads) * dim :], v)  # V untouched


def test_silu_and_mul():
    x = torch.randn(3, 2 * 40)
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(silu_and_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-6)


def test_router_selection_and_weights_equal_the_reference():
    torch.manual_seed(2)
    router = Router(64, 64, top_k=8, n_group=8, topk_group=4, scaling=2.5)
    router.weight.data.normal_()
    router.expert_bias.data.normal_(0, 0.1)
    x = torch.randn(9, 64)
    want_w, want_ids = router(x)
    router.kernel = grouped_topk_route
    got_w, got_ids = router(x)
    assert torch.equal(got_ids, want_ids)  # same experts in the same (descending) order
    assert torch.allclose(got_w, want_w, atol=1e-6)
