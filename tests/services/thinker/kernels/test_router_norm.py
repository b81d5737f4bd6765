"""The add + RMSNorm before a MoE layer folded into its router's launch (`router.normed_route`,
issue 40): the normed row and the residual sum are `norms.rms_norm`'s bit for bit (one set of norm
helpers, an exact fp64 sum of squares) and the routing is the router's of that row, bit for bit; the
rule folds one or two tokens on the gemv path and nothing else; the MoE block and the model with
the fold equal them without it; a decode step of one sequence launches no RMSNorm for a MoE layer's
post-attention norm with the fusions on (and does with them off; nor, the dense gate-up folding it,
for the dense layer's); and the tiny engine through the decode graph buffers gives the reference's
greedy tokens."""

from __future__ import annotations

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.cuda_graphs import DecodeGraphs
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.kernels import norms
from omnistage.services.thinker.kernels import router as router_kernels
from omnistage.services.thinker.kernels.dense_gate_up import NORM_MAX_TOKENS
from omnistage.services.thinker.kernels.norms import rms_norm
from omnistage.services.thinker.kernels.router import folds_norm, normed_route, route
from omnistage.services.thinker.kernels.tickets import tickets_for
from omnistage.services.thinker.models.layers.backends import (
    DENSE_GATEUP_ENV,
    FUSIONS_ENV,
    Backends,
    install_backends,
)
from omnistage.services.thinker.models.layers.moe import RouterRows, SparseMoeBlock
from omnistage.services.thinker.models.layers.norm import RMSNorm
from omnistage.services.thinker.models.layers.parallel import TPGroup

# (hidden, experts, groups, top groups, top-k, the gemv path's products a program or None): Ling-mini's
# router (its row in one chunk); an odd width read in five chunks, the last partial; Ming-flash's
# width (two chunks) with fewer experts.
SHAPES = {
    "ling-mini": (2048, 256, 8, 4, 8, None),
    "odd-width-in-chunks": (300, 64, 8, 4, 8, 256),
    "ming-flash-width": (4096, 64, 8, 4, 8, None),
}


def _operands(hidden, experts, tokens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    residual = (torch.randn(tokens, hidden, generator=g) * 4).to(dtype)
    norm_w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    gate = (torch.randn(experts, hidden, generator=g) * 0.05).to(dtype)
    bias = torch.randn(experts, generator=g) * 0.1
    return x, residual, norm_w, gate, bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_folded_norm_is_rms_norm_then_the_router_bit_for_bit(shape, tokens, dtype, launches, monkeypatch):
    hidden, experts, groups, top_groups, top_k, tile = SHAPES[shape]
    if tile is not None:
        monkeypatch.setattr(router_kernels, "_TILE_ELEMS", tile)
    x, residual, norm_w, gate, bias = _operands(hidden, experts, tokens, dtype, seed=hidden + tokens)
    normed, total = rms_norm(x, norm_w, 1e-6, residual)
    want_w, want_ids = route(normed, gate, bias, top_k, groups, top_groups, 2.5)
    launches.watch(router_kernels, "_route_kernel")
    for _ in range(2):  # the second launch reuses the tickets the first left
        got = normed_route(x, residual, norm_w, 1e-6, gate, bias, top_k, groups, top_groups, 2.5)
        assert got is not None
        got_w, got_ids, got_normed, got_total = got
        assert torch.equal(got_total, total) and torch.equal(got_normed, normed)
        assert got_normed.dtype == dtype and got_total.dtype == dtype
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    assert (
        launches.of("_route_kernel")
        == [((experts // router_kernels.gemv_block_e(1, hidden, experts), tokens, 1), None)] * 2
    )
    assert not tickets_for(x.device, 1).any()


def test_the_residual_is_read_with_its_row_stride():
    """A residual that is a slice of wider rows is read in place (its stride), not assumed dense."""
    x, residual, norm_w, gate, bias = _operands(96, 64, 2, torch.float32, seed=5)
    wide = torch.randn(2, 160)
    wide[:, 32:128] = residual
    sliced = wide[:, 32:128]
    got = normed_route(x, sliced, norm_w, 1e-6, gate, bias, 8, 8, 4, 1.0)
    want = normed_route(x, residual, norm_w, 1e-6, gate, bias, 8, 8, 4, 1.0)
    assert got is not None and want is not None
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_rule_folds_one_or_two_tokens_on_the_gemv_path_only(monkeypatch):
    def folds(tokens: int, dtype=torch.float32, norm_dtype=None) -> bool:
        x, residual, norm_w, gate, bias = _operands(64, 16, tokens, dtype, seed=tokens)
        norm_w = norm_w.to(norm_dtype or dtype)
        fused = normed_route(x, residual, norm_w, 1e-6, gate, bias, 4, 4, 2, 1.0)
        assert (fused is not None) == folds_norm(x, gate, residual, norm_w)  # one rule
        return fused is not None

    assert folds(1) and folds(2) and folds(2, torch.bfloat16)
    assert not folds(3)  # three tokens: the norm's launch, then the router's
    assert not folds(1, torch.bfloat16, torch.float32)  # the norm weight's dtype not x's
    x, residual, norm_w, gate, bias = _operands(64, 16, 1, torch.float32, seed=1)
    assert not folds_norm(x, gate, residual.bfloat16(), norm_w)  # a residual of another dtype
    strided = torch.randn(128)[::2]
    assert not folds_norm(x, gate, residual, strided)  # the norm weight read before the wait: no copy
    monkeypatch.setattr(router_kernels, "ROUTE_TABLE", ((8, "dot", 16),))  # no gemv path at one token
    assert not folds_norm(x, gate, residual, norm_w)
    assert normed_route(x, residual, norm_w, 1e-6, gate, bias, 4, 4, 2, 1.0) is None
    with pytest.raises(ValueError, match="gemv path only"):
        router_kernels._launch(x, gate, bias, (4, 4, 2, 1.0), "dot", None, None, (residual, norm_w, 1e-6))


def _block_and_norm(hidden: int = 64) -> torch.nn.ModuleDict:
    torch.manual_seed(7)
    block = SparseMoeBlock(hidden, 16, 32, 1, 4, 4, 2, 1.5, multi_router=True, tp=TPGroup())
    norm = RMSNorm(hidden)
    layers = torch.nn.ModuleDict({"mlp": block, "norm": norm})
    for p in layers.parameters():
        p.data.normal_(0, 0.1)
    norm.weight.data += 1.0
    return layers


def _normed(layers, x, residual, modality):
    with torch.no_grad():
        return layers["mlp"].normed(x, residual, layers["norm"], modality)


@pytest.mark.parametrize(
    "tokens,codes,folds",
    [
        (1, None, True),
        (2, "text", True),  # every token one code: one router for the step
        (2, "vision", True),  # ... the image gate's
        (1, "every-router", False),  # a graph's multimodal step: three routers
        (2, "mixed", False),  # a text and an audio token: two routers
        (3, None, False),  # past NORM_MAX_TOKENS
    ],
)
def test_the_moe_block_with_the_fold_equals_it_without(tokens, codes, folds, launches):
    layers = _block_and_norm()
    x, residual = torch.randn(tokens, 64), torch.randn(tokens, 64)
    modality = {
        None: None,
        "text": RouterRows.of(torch.zeros(tokens, dtype=torch.long), 3),
        "vision": RouterRows.of(torch.ones(tokens, dtype=torch.long), 3),
        "every-router": RouterRows.every_router(torch.ones(tokens, dtype=torch.long)),
        "mixed": torch.tensor([0, 2]),
    }[codes]
    want, want_sum = _normed(layers, x, residual, modality)  # the reference: norm, then the block
    install_backends(layers, Backends("triton", "triton"), fuse=True)
    launches.watch(norms, "_rms_norm_kernel")
    got, got_sum = _normed(layers, x, residual, modality)
    assert len(launches.of("_rms_norm_kernel")) == (0 if folds else 1)
    for name in layers["mlp"].router_names:  # the same kernels without the fold
        getattr(layers["mlp"], name).norm_kernel = None
    unfolded, unfolded_sum = _normed(layers, x, residual, modality)
    assert len(launches.of("_rms_norm_kernel")) == (1 if folds else 2)
    assert torch.equal(got, unfolded) and torch.equal(got_sum, unfolded_sum)
    assert torch.equal(got_sum, want_sum)
    assert ((got - want).norm() / want.norm()) < 1e-5


@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt_2_layers):
    from omnistage.services.thinker.models.loader import load_model

    return load_model(str(tiny_ckpt_2_layers), dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("tokens", [1, 2])
def test_the_model_with_the_fold_equals_it_without(tiny_model, tokens, launches):
    """The tiny model's dense layer and MoE layer (one sequence, no cache): the folds change
    nothing but the post-attention norm launches -- the MoE layer's in its router's launch, at one
    token the dense layer's in its gate-up launch (`GatedMLP.normed`)."""
    ids, positions = torch.tensor([5, 99][:tokens]), torch.arange(tokens)
    install_backends(tiny_model, Backends("torch", "torch"))
    with torch.no_grad():
        want = tiny_model(ids, positions)
    install_backends(tiny_model, Backends("triton", "triton"), fuse=True)
    post = [layer.post_attention_layernorm.weight.data_ptr() for layer in tiny_model.model.layers]
    launches.watch(norms, "_rms_norm_kernel")
    with torch.no_grad():
        got = tiny_model(ids, positions)
        folded = [args[2].data_ptr() for args in launches.arguments("_rms_norm_kernel")]
        tiny_model.model.layers[0].mlp.norm_gate_up_act = None
        for layer in tiny_model.model.layers[1:]:
            layer.mlp.gate.norm_kernel = None
        unfolded = tiny_model(ids, positions)
    normed = [args[2].data_ptr() for args in launches.arguments("_rms_norm_kernel")][len(folded) :]
    assert (post[0] in folded) == (tokens > NORM_MAX_TOKENS) and post[1] not in folded
    assert post[0] in normed and post[1] in normed
    assert torch.equal(got, unfolded)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


ENGINE_CFG = dict(block_size=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
PROMPT = [[17, 404]]  # two tokens: a prefill the fold serves, then one-sequence decode steps


@pytest.fixture(scope="module")
def reference_tokens(tiny_ckpt_2_layers):
    cfg = RankConfig(str(tiny_ckpt_2_layers), EngineConfig(**ENGINE_CFG), warmup=False)
    return [r.token_ids for r in rank0_engine(start_rank(cfg)).generate(PROMPT, PARAMS)]


@pytest.mark.parametrize("fusions", ["on", "off"])
def test_a_one_sequence_decode_step_launches_no_post_attention_norm_for_the_moe_layer(
    tiny_ckpt_2_layers, reference_tokens, fusions, launches, monkeypatch
):
    """Through the decode graph buffers (no capture), one sequence: with the fusions on the MoE
    layer's post-attention norm is in its router's launch (the prefill's two tokens and each
    decode step's one), with them off in a launch of its own; the greedy tokens are the
    reference's either way."""
    monkeypatch.setenv(FUSIONS_ENV, fusions)
    monkeypatch.delenv(DENSE_GATEUP_ENV, raising=False)
    launches.watch(norms, "_rms_norm_kernel")
    fast = EngineConfig(attention_backend="triton", moe_backend="triton", **ENGINE_CFG)
    engine = rank0_engine(start_rank(RankConfig(str(tiny_ckpt_2_layers), fast, warmup=False)))
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, 2, runner.cfg.max_blocks_per_seq, runner.device, capture=False)
    runner.use_graphs(graphs)
    steps = []  # the weights of each decode step's RMSNorm launches
    run = graphs.run

    def counted_run(plan, fill=None):
        before = len(launches.arguments("_rms_norm_kernel"))
        out = run(plan, fill)
        steps.append([args[2].data_ptr() for args in launches.arguments("_rms_norm_kernel")[before:]])
        return out

    graphs.run = counted_run
    assert [r.token_ids for r in engine.generate(PROMPT, PARAMS)] == reference_tokens
    layers = runner.model.model.layers
    dense_post, moe_post = (layer.post_attention_layernorm.weight.data_ptr() for layer in layers)
    every = [args[2].data_ptr() for args in launches.arguments("_rms_norm_kernel")]
    assert len(steps) == PARAMS.max_tokens - 1  # every decode step went through the buffers
    if fusions == "on":
        assert moe_post not in every  # neither the prefill's nor a decode step's
        # the dense layer's: the prefill's two tokens in a launch of their own, a decode step's one
        # in its gate-up launch (kernels/dense_gate_up.py)
        assert every.count(dense_post) == 1 and all(dense_post not in step for step in steps)
    else:
        assert every.count(moe_post) == PARAMS.max_tokens  # the prefill and each decode step
        assert all(step.count(moe_post) == 1 for step in steps)
