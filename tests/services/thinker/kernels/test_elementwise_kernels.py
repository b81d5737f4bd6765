"""RMSNorm (+ residual add), QK-norm + rope, SiLU·mul and the router (gate GEMV + grouped top-k)
in Triton equal the reference modules."""

from __future__ import annotations

import functools

import pytest
import torch
from omnistage.services.thinker.kernels import router as router_kernels
from omnistage.services.thinker.kernels.norms import qk_norm_rope, rms_norm, silu_and_mul
from omnistage.services.thinker.kernels.tickets import tickets_for
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


def test_the_norm_of_a_row_does_not_depend_on_the_order_it_is_summed_in():
    """The sum of squares is exact (fp64 over values with 8-bit significands, here 2^-6 to 2^6 in
    magnitude), so a row permuted -- a launch whose layout reduces in another order, the router's
    chunks (`router.normed_route`) -- gets the same rstd: the same fp32 normed row, bit for bit."""
    g = torch.Generator().manual_seed(4)
    mantissa = 1 + torch.randint(0, 128, (4, 2048), generator=g) / 128
    scale = 2.0 ** torch.randint(-6, 7, (4, 2048), generator=g)
    sign = torch.randint(0, 2, (4, 2048), generator=g) * 2 - 1
    x = (sign * mantissa * scale).float()  # bf16 values, as fp32 (whose products would show an rstd ulp)
    weight = torch.rand(2048, generator=g) + 0.5
    order = torch.randperm(2048, generator=g)
    want = rms_norm(x, weight, 1e-6)
    got = rms_norm(x[:, order], weight[order], 1e-6)
    assert torch.equal(got, want[:, order])


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
        got_q, got_k, _ = rows.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        got_q, got_k = got_q.view(tokens, q_heads, dim), got_k.view(tokens, kv_heads, dim)
        qk_norm_rope(got_q, got_k, q_norm.weight, k_norm.weight, 1e-6, cos, sin)
    assert torch.allclose(got_q, want_q, atol=1e-5)
    assert torch.allclose(got_k, want_k, atol=1e-5)
    assert torch.equal(rows[:, (q_heads + kv_heads) * dim :], v)  # V untouched


def test_silu_and_mul():
    x = torch.randn(3, 2 * 40)
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(silu_and_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-6)


@pytest.mark.parametrize(
    "tokens,fuse",
    [(1, True), (9, True), (20, True), (9, False)],
    ids=["one-token", "one-token-block", "two-token-blocks", "unfused"],
)
def test_router_equals_the_reference_and_leaves_its_tickets_at_zero(tokens, fuse):
    torch.manual_seed(2)
    router = Router(72, 64, top_k=8, n_group=8, topk_group=4, scaling=2.5)  # 72: a partial hidden chunk
    router.weight.data.normal_()
    router.expert_bias.data.normal_(0, 0.1)
    x = torch.randn(tokens, 72)
    want_w, want_ids = router(x)
    router.kernel = functools.partial(router_kernels.route, fuse=fuse)
    for _ in range(2):  # the second launch reuses the tickets the first left
        got_w, got_ids = router(x)
        assert torch.equal(got_ids, want_ids)  # same experts in the same (descending) order
        assert torch.allclose(got_w, want_w, atol=1e-6)
    assert not tickets_for(x.device, 1).any()


@pytest.mark.parametrize("fuse", [True, False])
def test_router_ties_go_to_the_lower_group_and_expert(fuse):
    router = Router(16, 64, top_k=8, n_group=8, topk_group=4, scaling=1.0)
    router.weight.data.zero_()  # every score 0.5: all groups and experts tie
    router.expert_bias.data.zero_()
    router.kernel = functools.partial(router_kernels.route, fuse=fuse)
    w, ids = router(torch.randn(3, 16))
    assert ids.tolist() == [list(range(8))] * 3 and torch.allclose(w, torch.full_like(w, 1 / 8))


def test_a_prefill_routes_through_the_reference_gemv_and_the_one_launch_selection(monkeypatch):
    torch.manual_seed(3)
    router = Router(32, 16, top_k=4, n_group=4, topk_group=2, scaling=1.0)
    router.weight.data.normal_()
    router.expert_bias.data.normal_(0, 0.1)
    x = torch.randn(6, 32)
    want_w, want_ids = router(x)
    monkeypatch.setattr(router_kernels, "ROUTE_TABLE", ((4, "gemv", 4),))
    launches = []
    kernel = router_kernels._route_kernel

    class Recorded:  # the launch's grid and constants, then the kernel itself
        def __getitem__(self, grid):
            def launch(*args, **constants):
                launches.append((grid, constants["GEMV"], constants["BLOCK_T"]))
                return kernel[grid](*args, **constants)

            return launch

    monkeypatch.setattr(router_kernels, "_route_kernel", Recorded())
    router.kernel = router_kernels.route
    got_w, got_ids = router(x)
    assert torch.equal(got_ids, want_ids) and torch.allclose(got_w, want_w, atol=1e-6)
    assert launches == [((1, 6, 1), False, 1)]  # no fused GEMM: one launch, a program a token
