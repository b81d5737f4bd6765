"""A MoE layer of one token with its experts selected in the streaming gate-up launch
(`kernels/gate_up_select.py`, issue 40): the router's logits-only launch (`router.normed_logits`) and
the gate-up's own selection give the ids, the routing weights and the layer's output of
`router.normed_route` then `moe_one_token.one_token_experts`, bit for bit (fp32 and bf16, a tiny and a
Ling-like router, ties); the three launches run in that order with the down reading the ids after its
wait, or with OMNISTAGE_THINKER_DOWN_FLAG=on before it too on the gate-up's ids-ready flag (
test_ready_flag.py); the dispatch rule takes one token on the router's fold with the streaming
gate-up and nothing else; the switch installs it on the MoE block (by default up to a hidden size) and the block's
output is unchanged; and the tiny engine's greedy tokens are unchanged with it on, the flag on or
off."""

from __future__ import annotations

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.cuda_graphs import DecodeGraphs
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.kernels import moe_one_token, ready_flag, router
from omnistage.services.thinker.kernels.gate_up_select import normed_select_experts, selects
from omnistage.services.thinker.kernels.moe_one_token import (
    OneTokenTiles,
    RouterLogits,
    one_token_experts,
    selecting_experts,
)
from omnistage.services.thinker.kernels.router import normed_logits, normed_route
from omnistage.services.thinker.models.layers.backends import (
    DOWN_FLAG_ENV,
    GATEUP_SELECT_ENV,
    SELECT_MAX_HIDDEN,
    BackendError,
    Backends,
    down_flag_enabled,
    gateup_select,
    install_backends,
)

from tests.services.thinker.kernels.test_router_norm import _block_and_norm

# (hidden, intermediate, experts, groups, groups kept, top-k): a tiny router, and Ling-mini's router
# (256 experts, 8 groups, the top 4 groups, top-8) on small rows.
SHAPES = {"tiny": (96, 40, 16, 4, 2, 4), "ling-like": (128, 32, 256, 8, 4, 8)}
SCALING, EPS = 2.5, 1e-6


def _layer(shape, dtype, seed, ties=False):
    hidden, inter, experts, groups, kept, top_k = shape
    g = torch.Generator().manual_seed(seed)

    def rand(*size, scale=0.1):
        return (torch.randn(*size, generator=g) * scale).to(dtype)

    gate, bias = rand(experts, hidden), torch.randn(experts, generator=g) * 0.01
    if ties:  # every expert the twin of its neighbour: equal logits and bias, ties at every pick
        gate, bias = gate[::2].repeat_interleave(2, 0), bias[::2].repeat_interleave(2)
    return dict(
        row=(rand(1, hidden, scale=1.0), rand(1, hidden, scale=2.0), (1 + rand(hidden)).contiguous(), EPS),
        gate=gate.contiguous(),
        bias=bias,
        experts=(rand(experts, 2 * inter, hidden), rand(experts, hidden, inter)),
        shared=(rand(2 * inter, hidden), rand(hidden, inter)),
        route=(top_k, groups, kept, SCALING),
    )


def _today(p):
    """Today's launches: the router selects (its ticket, its last program), then the experts."""
    weights, ids, normed, total = normed_route(*p["row"], p["gate"], p["bias"], *p["route"])
    return weights, ids, one_token_experts(normed, *p["experts"], weights, ids, p["shared"]), total


def _selecting(p):
    top_k, groups, kept, scaling = p["route"]
    logits, normed, total = normed_logits(*p["row"], p["gate"], p["bias"], groups, kept, top_k)
    select = RouterLogits(logits, p["bias"], groups, kept, top_k, scaling)
    out, weights, ids = selecting_experts(normed, *p["experts"], select, p["shared"])
    return weights, ids, out, total


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_gate_ups_selection_is_the_routers_bit_for_bit(name, dtype, ties):
    p = _layer(SHAPES[name], dtype, seed=7, ties=ties)
    want_w, want_ids, want_out, want_sum = _today(p)
    got_w, got_ids, got_out, got_sum = _selecting(p)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    assert torch.equal(got_out, want_out) and torch.equal(got_sum, want_sum)
    assert got_out.dtype == dtype
    layer = normed_select_experts(*p["row"], p["gate"], p["bias"], p["route"], p["experts"], p["shared"])
    assert layer is not None
    assert torch.equal(layer[0], want_out) and torch.equal(layer[1], want_sum)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_all_ties_pick_the_lowest_groups_and_experts(name):
    """Every logit and bias equal: the first groups kept, their lowest experts, equal weights."""
    p = _layer(SHAPES[name], torch.float32, seed=3)
    p["gate"], p["bias"] = torch.zeros_like(p["gate"]), torch.zeros_like(p["bias"])
    want_w, want_ids, want_out, _ = _today(p)
    got_w, got_ids, got_out, _ = _selecting(p)
    top_k = p["route"][0]
    assert got_ids.tolist() == [list(range(top_k))] == want_ids.tolist()
    assert torch.equal(got_w, want_w) and torch.equal(got_w, torch.full((1, top_k), SCALING / top_k))
    assert torch.equal(got_out, want_out)


class _Recorded:
    """A kernel whose launches (name, constexprs) are appended to `log`."""

    def __init__(self, kernel, name: str, log: list) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **constants):
            self.log.append((self.name, constants))
            return self.kernel[grid](*args, **constants)

        return launch


def test_three_launches_the_router_selecting_nothing_the_down_reading_the_ids_after_its_wait(monkeypatch):
    log: list = []
    for module, name in [
        (router, "_route_kernel"),
        (moe_one_token, "_one_token_gate_up_stream_kernel"),
        (moe_one_token, "_one_token_down_kernel"),
    ]:
        monkeypatch.setattr(module, name, _Recorded(getattr(module, name), name, log))
    p = _layer(SHAPES["tiny"], torch.float32, seed=2)
    args = (*p["row"], p["gate"], p["bias"], p["route"], p["experts"], p["shared"])

    def launched() -> list[tuple]:
        got = [
            (n, c.get("SELECT"), c.get("IDS_SETTLED"), c.get("FLAG"), c.get("IDS_FLAGGED")) for n, c in log
        ]
        log.clear()
        return got

    normed_select_experts(*args, flag=False)
    assert launched() == [
        ("_route_kernel", False, None, None, None),
        ("_one_token_gate_up_stream_kernel", True, None, False, None),
        ("_one_token_down_kernel", None, False, None, False),
    ]
    normed_select_experts(*args)  # the flag by default: the gate-up raises it, the down polls it
    assert launched() == [
        ("_route_kernel", False, None, None, None),
        ("_one_token_gate_up_stream_kernel", True, None, True, None),
        ("_one_token_down_kernel", None, False, None, True),
    ]
    _today(p)  # today's: the router selects, the gate-up reads its ids, the down reads them early
    assert launched() == [
        ("_route_kernel", True, None, None, None),
        ("_one_token_gate_up_stream_kernel", False, None, False, None),
        ("_one_token_down_kernel", None, True, None, False),
    ]


def test_the_dispatch_rule(monkeypatch):
    p = _layer(SHAPES["tiny"], torch.float32, seed=1)
    (x, residual, norm_w, _), top_k, groups = p["row"], p["route"][0], p["route"][1]

    def rule(x=x, residual=residual, norm_w=norm_w, gate=p["gate"], groups=groups, top_k=top_k, **kw):
        args = dict(experts=p["experts"], shared=p["shared"]) | kw
        return selects(x, residual, norm_w, gate, groups, top_k, args["experts"], args["shared"])

    assert rule()
    two = torch.cat([x, x])
    assert not rule(x=two, residual=torch.cat([residual, residual]))  # two tokens: the router selects
    assert not rule(shared=None)  # no shared expert: not the one-token experts
    assert not rule(residual=residual.bfloat16())  # the router does not fold the norm
    assert not rule(groups=3)  # groups of a shape the selection does not take
    assert not rule(top_k=3)  # a top-k not a power of two
    w13, w2 = p["experts"]
    assert not rule(experts=(w13.bfloat16(), w2.bfloat16()))  # mixed dtypes
    args = (*p["row"], p["gate"], p["bias"], p["route"], p["experts"])
    assert normed_select_experts(*args, None) is None  # no launch where the rule says no
    monkeypatch.setattr(moe_one_token, "sm_count", lambda device: 0)  # a gate-up of a program a tile
    assert not rule()


def test_a_gate_up_of_a_program_a_tile_refuses_to_select():
    p = _layer(SHAPES["tiny"], torch.float32, seed=1)
    top_k, groups, kept, scaling = p["route"]
    logits, normed, _ = normed_logits(*p["row"], p["gate"], p["bias"], groups, kept, top_k)
    select = RouterLogits(logits, p["bias"], groups, kept, top_k, scaling)
    with pytest.raises(ValueError, match="only when it streams"):
        selecting_experts(normed, *p["experts"], select, p["shared"], OneTokenTiles(8, 8, 4))


def test_the_switch_selects_in_the_gate_up_up_to_the_measured_hidden_size_by_default(monkeypatch):
    """auto (unset): the gate-up selects at Ling-mini's hidden size (measured faster), not at Ming-flash's
    (measured slower); on / off at every size; anything else refused, naming the variable."""
    monkeypatch.delenv(GATEUP_SELECT_ENV, raising=False)
    assert SELECT_MAX_HIDDEN == 2048
    assert [gateup_select(h) for h in (64, 2048, 2049, 4096)] == [True, True, False, False]
    monkeypatch.setenv(GATEUP_SELECT_ENV, "ON")
    assert gateup_select(4096) and gateup_select(64)
    monkeypatch.setenv(GATEUP_SELECT_ENV, "off")
    assert not gateup_select(64)
    monkeypatch.setenv(GATEUP_SELECT_ENV, "yes")
    with pytest.raises(BackendError, match="OMNISTAGE_THINKER_GATEUP_SELECT='yes': expected auto, on or off"):
        gateup_select(64)


def test_by_default_a_block_past_the_measured_hidden_size_keeps_the_routers_selection(monkeypatch):
    monkeypatch.delenv(GATEUP_SELECT_ENV, raising=False)
    small, large = _block_and_norm(), _block_and_norm(hidden=SELECT_MAX_HIDDEN * 2)
    for layers in (small, large):
        install_backends(layers, Backends("triton", "triton"), fuse=True)
    assert small["mlp"].select_kernel is not None and large["mlp"].select_kernel is None
    first_router = getattr(large["mlp"], large["mlp"].router_names[0])
    assert first_router.norm_kernel is not None  # the router's launch folds the norm and selects


def test_the_down_flag_switch_is_off_by_default_and_takes_on_or_off_only(monkeypatch):
    monkeypatch.delenv(DOWN_FLAG_ENV, raising=False)
    assert not down_flag_enabled()
    monkeypatch.setenv(DOWN_FLAG_ENV, "ON")
    assert down_flag_enabled()
    monkeypatch.setenv(DOWN_FLAG_ENV, "1")
    with pytest.raises(BackendError, match="OMNISTAGE_THINKER_DOWN_FLAG='1': expected on or off"):
        down_flag_enabled()


@pytest.mark.parametrize(
    "switch,fuse,tokens,selects_here,flag",
    [
        ("on", True, 1, True, "on"),
        ("on", True, 1, True, "off"),
        ("on", True, 2, False, "on"),  # two tokens: the router's fold selects
        ("on", False, 1, False, "on"),  # the fusions off: no fold, nothing installed
        ("off", True, 1, False, "on"),
    ],
)
def test_the_moe_block_with_the_switch_equals_it_without(
    switch, fuse, tokens, selects_here, flag, monkeypatch
):
    layers = _block_and_norm()
    x, residual = torch.randn(tokens, 64), torch.randn(tokens, 64)
    monkeypatch.setenv(GATEUP_SELECT_ENV, "off")
    install_backends(layers, Backends("triton", "triton"), fuse=fuse)
    assert layers["mlp"].select_kernel is None
    with torch.no_grad():
        want, want_sum = layers["mlp"].normed(x, residual, layers["norm"])
    monkeypatch.setenv(GATEUP_SELECT_ENV, switch)
    monkeypatch.setenv(DOWN_FLAG_ENV, flag)
    install_backends(layers, Backends("triton", "triton"), fuse=fuse)
    assert (layers["mlp"].select_kernel is not None) == (switch == "on" and fuse)
    calls = []
    real = moe_one_token.selecting_experts
    monkeypatch.setattr(
        moe_one_token, "selecting_experts", lambda *a, **k: calls.append(k["flag"]) or real(*a, **k)
    )
    with torch.no_grad():
        got, got_sum = layers["mlp"].normed(x, residual, layers["norm"])
    assert calls == ([flag == "on"] if selects_here else [])
    assert torch.equal(got, want) and torch.equal(got_sum, want_sum)


ENGINE_CFG = dict(block_size=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("flag", ["on", "off"])
def test_the_tiny_engines_greedy_tokens_are_unchanged_with_the_switch_on(
    tiny_ckpt_2_layers, flag, monkeypatch
):
    prompt = [[5, 99, 812]]
    fast = EngineConfig(attention_backend="triton", moe_backend="triton", **ENGINE_CFG)

    def tokens() -> list[list[int]]:
        engine = rank0_engine(start_rank(RankConfig(str(tiny_ckpt_2_layers), fast, warmup=False)))
        runner = engine.runner
        runner.use_graphs(
            DecodeGraphs(runner.model, 2, runner.cfg.max_blocks_per_seq, runner.device, capture=False)
        )
        return [r.token_ids for r in engine.generate(prompt, PARAMS)]

    want = tokens()
    monkeypatch.setenv(GATEUP_SELECT_ENV, "on")
    monkeypatch.setenv(DOWN_FLAG_ENV, flag)  # the down reading early on the ids-ready flag, or not
    calls, selected = [], []
    real = moe_one_token.selecting_experts
    monkeypatch.setattr(
        moe_one_token, "selecting_experts", lambda *a, **k: calls.append(k["flag"]) or real(*a, **k)
    )
    real_route = router.normed_route

    def normed_route(*args):
        out = real_route(*args)
        selected.append(out is not None)  # a launch that selected (None: its rule said no)
        return out

    monkeypatch.setattr(router, "normed_route", normed_route)
    assert tokens() == want
    # Each decode step's MoE layer selects in its gate-up; the router's selecting launch never runs
    # (the three-token prefill is past its fold: the norm, then the router).
    assert calls == [flag == "on"] * (PARAMS.max_tokens - 1) and not any(selected)
    assert not ready_flag.flag_for(torch.device("cpu")).any()
