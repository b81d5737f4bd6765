"""One token's routed experts in two launches (`kernels/moe_one_token.py`) equal the aligned path
(fp32) and the reference loop (bf16, within its roundings); the dispatch rule takes one token with a
foldable shared expert and nothing else; `fused_experts` sends a decode step of one sequence there
with the fusions on (not off); and the tiny engine's one-sequence decode steps through the graph
buffers give the reference's greedy tokens on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.cuda_graphs import DecodeGraphs
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.kernels import moe_one_token
from omnistage.services.thinker.kernels.fused_moe import fused_experts
from omnistage.services.thinker.kernels.moe_one_token import OneTokenTiles, one_token_experts, supported
from omnistage.services.thinker.models.layers.backends import GATEUP_SELECT_ENV


def _case(
    dtype: torch.dtype, experts: int = 16, hidden: int = 96, inter: int = 40, top_k: int = 4, seed: int = 0
):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x = rand(1, hidden, scale=1.0)
    w13, w2 = rand(experts, 2 * inter, hidden), rand(experts, hidden, inter)
    shared = (rand(2 * inter, hidden), rand(hidden, inter))
    ids = torch.randperm(experts, generator=g)[:top_k][None]
    weights = torch.rand(1, top_k, generator=g)
    return x, w13, w2, weights, ids, shared


def _reference_loop(x, w13, w2, weights, ids, shared):
    """FusedExperts' reference: each expert's output in the activation dtype, weighted and summed
    in fp32, rounded, plus the shared expert's output."""
    out = torch.zeros(1, x.shape[1])
    for slot, expert in enumerate(ids[0].tolist()):
        gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)
        out += F.linear(F.silu(gate) * up, w2[expert]).float() * weights[0, slot]
    gate, up = F.linear(x, shared[0]).chunk(2, dim=-1)
    return out.to(x.dtype) + F.linear(F.silu(gate) * up, shared[1])


@pytest.mark.parametrize(
    "tiles",
    [
        None,
        OneTokenTiles(gate_up_rows=8, down_rows=16, warps=2),
        OneTokenTiles(16, 32, 4),
        OneTokenTiles(4, 16, 4, programs=3),  # streaming: each program loops over its tiles
        OneTokenTiles(8, 16, 2, programs=64),  # more programs than tiles: the rest have none
    ],
)
def test_fp32_equals_the_aligned_path(tiles):
    x, w13, w2, weights, ids, shared = _case(torch.float32)
    got = one_token_experts(x, w13, w2, weights, ids, shared, tiles)
    want = fused_experts(x, w13, w2, weights, ids, shared, fuse=False)
    assert got.shape == (1, 96) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_is_the_reference_within_its_roundings():
    case = _case(torch.bfloat16, seed=3)
    got, want = one_token_experts(*case), _reference_loop(*case)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=3e-2)


def test_the_streaming_gate_up_gives_the_bits_of_a_program_a_tile():
    case = _case(torch.bfloat16, seed=5)
    plain = one_token_experts(*case, OneTokenTiles(4, 16, 4))
    for programs in (1, 3, 64):  # one program for every tile, a loop each, more programs than tiles
        assert torch.equal(one_token_experts(*case, OneTokenTiles(4, 16, 4, programs=programs)), plain)


def test_the_same_inputs_give_the_same_bits():
    case = _case(torch.bfloat16, seed=4)
    assert torch.equal(one_token_experts(*case), one_token_experts(*case))


def test_the_gate_up_streams_in_programs_an_sm_where_the_device_is_known():
    ling = dict(hidden=2048, inter=512, top_k=8, element_size=2)
    streamed = moe_one_token.default_tiles(**ling, sms=132)
    assert (streamed.programs, streamed.gate_up_rows) == (
        moe_one_token.STREAM_PROGRAMS_PER_SM * 132,
        moe_one_token.STREAM_ROWS,
    )
    plain = moe_one_token.default_tiles(**ling)
    assert (plain.programs, plain.gate_up_rows, plain.down_rows) == (0, 8, 4)  # 64 KiB a program
    assert streamed.down_rows == plain.down_rows
    assert moe_one_token.sm_count(torch.device("cpu")) == 1  # the CPU tests take the streaming path


def test_the_dispatch_rule():
    x, w13, w2, weights, ids, shared = _case(torch.float32)
    assert supported(x, w13, w2, ids, shared)
    two = torch.cat([ids, ids])
    assert not supported(torch.cat([x, x]), w13, w2, two, shared)  # two tokens: the aligned path
    assert not supported(x, w13, w2, ids, None)  # no shared expert
    assert not supported(x, w13, w2, ids, (shared[0][:8], shared[1][:, :4]))  # not an expert's shape
    assert not supported(x, w13, w2, ids[:, :3], shared)  # top-3: not a power of two
    assert not supported(x.bfloat16(), w13, w2, ids, shared)  # mixed dtypes


def test_fused_experts_takes_it_for_one_token_with_the_fusions_on(monkeypatch):
    calls = []
    real = moe_one_token.one_token_experts
    monkeypatch.setattr(moe_one_token, "one_token_experts", lambda *a: calls.append(1) or real(*a))
    x, w13, w2, weights, ids, shared = _case(torch.float32)
    on = fused_experts(x, w13, w2, weights, ids, shared, fuse=True)
    assert calls == [1]
    off = fused_experts(x, w13, w2, weights, ids, shared, fuse=False)
    assert calls == [1] and torch.allclose(on, off, rtol=1e-5, atol=1e-5)


ENGINE_CFG = dict(block_size=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def test_tiny_engine_one_sequence_decode_equals_the_reference(tiny_ckpt_2_layers, monkeypatch):
    prompt = [[5, 99, 812]]
    reference = rank0_engine(
        start_rank(RankConfig(str(tiny_ckpt_2_layers), EngineConfig(**ENGINE_CFG), warmup=False))
    )
    want = [r.token_ids for r in reference.generate(prompt, PARAMS)]
    monkeypatch.setenv(GATEUP_SELECT_ENV, "off")  # the router selects (test_gate_up_select.py: the gate-up)
    calls = []
    real = moe_one_token.one_token_experts
    monkeypatch.setattr(
        moe_one_token, "one_token_experts", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    fast = EngineConfig(attention_backend="triton", moe_backend="triton", **ENGINE_CFG)
    engine = rank0_engine(start_rank(RankConfig(str(tiny_ckpt_2_layers), fast, warmup=False)))
    runner = engine.runner
    runner.use_graphs(
        DecodeGraphs(runner.model, 2, runner.cfg.max_blocks_per_seq, runner.device, capture=False)
    )
    assert [r.token_ids for r in engine.generate(prompt, PARAMS)] == want
    assert calls == [1] * (PARAMS.max_tokens - 1)  # the MoE layer of each decode step, not the prefill
