"""On a GPU (skipped without CUDA): the decode step's fused MoE glue (router GEMV + selection in one
launch, one-launch alignment with the shared expert folded in, one-launch sum) gives the eager
engine's greedy tokens through CUDA graphs in bf16, the reference's in fp32, and at Ling-mini's MoE
shapes in bf16 the reference's experts and mixes (the router's tickets left at zero, launch after
launch), and with a MoE layer's post-attention add + norm in the router's launch the unfused
launches' rows and routing bit for bit. Here, not in kernels/, whose conftest runs Triton in its
interpreter."""

from __future__ import annotations

import random

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.models.layers.backends import FUSIONS_ENV
from omnistage.services.thinker.models.layers.moe import FusedExperts, GatedMLP, Router
from omnistage.services.thinker.models.layers.parallel import TPGroup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# A pinned KV size: two engines live at once here, and an auto-sized one takes the whole card.
CFG = dict(block_size=16, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, kv_tokens=4096)


def engine(ckpt, dtype: str, **engine_cfg) -> LLMEngine:
    cfg = RankConfig(str(ckpt), EngineConfig(**CFG, **engine_cfg), dtype=dtype, device="cuda:0")
    return rank0_engine(start_rank(cfg))


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(0, 900) for _ in range(rng.randrange(8, 100))] for _ in range(n)]


def tokens(e: LLMEngine, n: int = 6) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    return [r.token_ids for r in e.generate(prompts(n), params)]


def test_bf16_graphs_give_the_eager_tokens_with_the_fusions_on(tiny_ckpt, monkeypatch):
    monkeypatch.setenv(FUSIONS_ENV, "on")
    eager = engine(tiny_ckpt, "bfloat16", cuda_graphs=False)
    assert eager.runner.graphs is None
    graphs = engine(tiny_ckpt, "bfloat16", cuda_graphs=True)
    replays = graphs.runner.graphs.replays
    assert tokens(graphs) == tokens(eager)
    assert graphs.runner.graphs.replays > replays


def test_fp32_fused_graphs_give_the_reference_tokens(tiny_ckpt, monkeypatch):
    monkeypatch.setenv(FUSIONS_ENV, "on")
    reference = engine(tiny_ckpt, "float32", attention_backend="torch", moe_backend="torch")
    assert tokens(engine(tiny_ckpt, "float32")) == tokens(reference)


def test_the_fused_router_picks_the_references_experts_at_ling_mini_shape():
    from omnistage.services.thinker.kernels import router as kernels
    from omnistage.services.thinker.kernels.tickets import tickets_for

    torch.manual_seed(0)
    dev = torch.device("cuda")
    router = Router(2048, 256, top_k=8, n_group=8, topk_group=4, scaling=2.5).to(dev, torch.bfloat16)
    router.weight.data.normal_(0, 0.02)
    router.expert_bias.data.normal_(0, 0.01)
    same = total = 0
    for t in (1, 2, 3, 8, 16, 40, 64, 300):  # gemv (2: a block of two miscompiled), dot, cuBLAS
        for _ in range(20):  # launch after launch on the same tickets
            x = torch.randn(t, 2048, device=dev, dtype=torch.bfloat16)
            router.kernel = None
            want_w, want_ids = router(x)
            router.kernel = kernels.route
            got_w, got_ids = router(x)
            rows = (got_ids == want_ids).all(dim=1)
            same, total = same + int(rows.sum()), total + t
            assert torch.allclose(got_w[rows], want_w[rows], atol=1e-5)
    assert same >= 0.99 * total  # fp32 sums in another order: a near-tie may flip, rarely
    assert not tickets_for(dev, 1).any()


@pytest.mark.parametrize("hidden", [2048, 4096], ids=["ling-mini", "ming-flash-tp2"])
def test_the_folded_post_attention_norm_is_rms_norm_then_the_router_bit_for_bit(hidden):
    """The router with the MoE layer's add + RMSNorm in its launch (`router.normed_route`, one or two
    tokens) stores rms_norm's normed row and residual sum bit for bit (the same helpers; an exact
    fp64 sum of squares, whatever order the compiled layouts reduce in) and routes that row as the
    router does (the same logits' reduction layout), launch after launch."""
    from omnistage.services.thinker.kernels import router as kernels
    from omnistage.services.thinker.kernels.norms import rms_norm
    from omnistage.services.thinker.kernels.tickets import tickets_for

    torch.manual_seed(hidden)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gate = (torch.randn(256, hidden, device=dev) * 0.02).to(dtype)
    bias = torch.randn(256, device=dev) * 0.01
    norm_w = (torch.rand(hidden, device=dev) + 0.5).to(dtype)
    for t in (1, 2):
        for _ in range(20):
            x = torch.randn(t, hidden, device=dev).to(dtype)
            residual = torch.randn(t, hidden, device=dev) * 2.0 ** torch.randint(
                -6, 7, (t, hidden), device=dev
            )
            residual = residual.to(dtype)  # magnitudes over 2^12: the fp32 sum's order would show
            normed, total = rms_norm(x, norm_w, 1e-6, residual)
            want_w, want_ids = kernels.route(normed, gate, bias, 8, 8, 4, 2.5)
            got = kernels.normed_route(x, residual, norm_w, 1e-6, gate, bias, 8, 8, 4, 2.5)
            assert got is not None
            got_w, got_ids, got_normed, got_total = got
            assert torch.equal(got_total, total) and torch.equal(got_normed, normed)
            assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    assert not tickets_for(dev, 1).any()


@pytest.mark.parametrize("batch", [1, 8, 32, 64])
def test_fused_experts_with_the_shared_expert_folded_in_match_the_reference_in_bf16(batch):
    torch.manual_seed(batch)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    experts = FusedExperts(256, 2048, 512, TPGroup()).to(dev, dtype)
    shared = GatedMLP(2048, 512, TPGroup(), reduce=False).to(dev, dtype)
    for p in (experts.w13, experts.w2, shared.gate_up_proj.weight, shared.down_proj.weight):
        p.data.normal_(0, 0.02)
    x = torch.randn(batch, 2048, device=dev, dtype=dtype)
    ids = torch.stack([torch.randperm(256, device=dev)[:8] for _ in range(batch)])
    weights = torch.rand(batch, 8, device=dev)
    want = experts(x, weights, ids, shared).float()
    from omnistage.services.thinker.kernels.fused_moe import fused_experts

    pair = (shared.gate_up_proj.weight, shared.down_proj.weight)
    for fuse in (True, False):
        got = fused_experts(x, experts.w13, experts.w2, weights, ids, pair, fuse=fuse).float()
        assert ((got - want).norm() / want.norm()) < 2e-2
