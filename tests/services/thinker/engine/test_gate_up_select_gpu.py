"""On a GPU (skipped without CUDA): one token's experts selected in the streaming gate-up launch
(`kernels/gate_up_select.py`, OMNISTAGE_THINKER_GATEUP_SELECT) give the ids, routing weights, output
and residual sum of today's launches (`router.normed_route` then `moe_one_token.one_token_experts`) bit
for bit at Ling-mini's and Ming-flash TP=2's per-rank shapes in bf16 -- eagerly and replayed from one
CUDA graph of several layers, where under PDL the down launch reads the ids program 0 of the gate-up
stored, one launch back, after its wait, or by default before it too where it sees the gate-up's
ids-ready flag (OMNISTAGE_THINKER_DOWN_FLAG: the same bits as after the wait, the flag word zero
after every replay, the poll and the chosen rows' loads before the wait in the compiled down) -- and
the tiny engine's greedy tokens through CUDA graphs are the same with the switch on and off, the
flag on and off. Here, not in kernels/, whose conftest runs Triton in its
interpreter."""

from __future__ import annotations

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.models.layers.backends import DOWN_FLAG_ENV, GATEUP_SELECT_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (hidden, intermediate, experts, groups, groups kept, top-k)
SHAPES = {"ling-mini": (2048, 512, 256, 8, 4, 8), "ming-flash-tp2-rank": (4096, 512, 256, 8, 4, 8)}
LAYERS = 4


def _layers(shape, seed: int) -> list[dict]:
    hidden, inter, experts, groups, kept, top_k = shape
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*size, scale=0.02):
        return (torch.randn(*size, generator=g, device="cuda") * scale).to(torch.bfloat16)

    return [
        dict(
            norm=(rand(hidden, scale=0.5) + 1).contiguous(),
            gate=rand(experts, hidden),
            bias=torch.randn(experts, generator=g, device="cuda") * 0.01,
            experts=(rand(experts, 2 * inter, hidden), rand(experts, hidden, inter)),
            shared=(rand(2 * inter, hidden), rand(hidden, inter)),
            route=(top_k, groups, kept, 2.5),
        )
        for _ in range(LAYERS)
    ]


def _today(w, x, residual):
    from omnistage.services.thinker.kernels.moe_one_token import one_token_experts
    from omnistage.services.thinker.kernels.router import normed_route

    rw, ids, normed, total = normed_route(x, residual, w["norm"], 1e-6, w["gate"], w["bias"], *w["route"])
    return one_token_experts(normed, *w["experts"], rw, ids, w["shared"]), total, rw, ids


def _selecting(w, x, residual, flag: bool = True):
    from omnistage.services.thinker.kernels.moe_one_token import RouterLogits, selecting_experts
    from omnistage.services.thinker.kernels.router import normed_logits

    top_k, groups, kept, scaling = w["route"]
    logits, normed, total = normed_logits(
        x, residual, w["norm"], 1e-6, w["gate"], w["bias"], groups, kept, top_k
    )
    select = RouterLogits(logits, w["bias"], groups, kept, top_k, scaling)
    out, rw, ids = selecting_experts(normed, *w["experts"], select, w["shared"], flag=flag)
    return out, total, rw, ids


def _after_wait(w, x, residual):
    """The selecting path with the down reading the ids only after its wait (no ids-ready flag)."""
    return _selecting(w, x, residual, flag=False)


def _chain(path, layers, x, residual) -> list[torch.Tensor]:
    """Each layer's (output, sum, weights, ids) on the same row, the layers one after another."""
    return [t for w in layers for t in path(w, x, residual)]


def _captured(paths: dict, layers, x, residual) -> tuple[dict, dict]:
    """Each path's chain of layers in a CUDA graph of its own (run eagerly first: compiled before the
    capture), and the outputs the graphs write."""
    graphs, outs = {}, {}
    for key, path in paths.items():
        _chain(path, layers, x, residual)
        torch.cuda.synchronize()
        graphs[key] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[key]):
            outs[key] = _chain(path, layers, x, residual)
    return graphs, outs


def _new_rows(x: torch.Tensor, residual: torch.Tensor) -> None:
    x.copy_(torch.randn(*x.shape, device="cuda").to(torch.bfloat16))
    residual.copy_(torch.randn(*residual.shape, device="cuda").to(torch.bfloat16))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_gate_ups_selection_is_the_routers_bit_for_bit_eager_and_in_a_graph(name):
    from omnistage.services.thinker.kernels.gate_up_select import selects

    layers = _layers(SHAPES[name], seed=len(name))
    hidden = SHAPES[name][0]
    for step in range(5):
        x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
        residual = (torch.randn(1, hidden, device="cuda") * 2).to(torch.bfloat16)
        w = layers[0]
        assert selects(
            x, residual, w["norm"], w["gate"], w["route"][1], w["route"][0], w["experts"], w["shared"]
        )
        want, got = _chain(_today, layers, x, residual), _chain(_selecting, layers, x, residual)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), step
    x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    residual = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    graphs, outs = _captured({"today": _today, "selecting": _selecting}, layers, x, residual)
    for _ in range(3):  # new rows in place, each graph replayed on them
        _new_rows(x, residual)
        for graph in graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        eager = _chain(_today, layers, x, residual)
        assert all(torch.equal(a, b) for a, b in zip(outs["selecting"], outs["today"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(outs["today"], eager, strict=True))


def _loads_before_wait(ptx: str) -> int:
    """Global loads of weights (neither .cg, the ids', nor volatile, the flag's) before the PDL wait."""
    head = ptx[: ptx.find("griddepcontrol.wait")]
    return sum(
        1
        for line in head.splitlines()
        if "ld.global" in line and ".cg" not in line and "volatile" not in line
    )


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_flagged_down_is_the_after_wait_downs_bit_for_bit_and_leaves_the_flag_zero(name, monkeypatch):
    """OMNISTAGE_THINKER_DOWN_FLAG's down (the ids and its rows before its wait where the gate-up's
    flag is seen): the bits of the down reading them after its wait and of today's launches, eager
    and replayed from one CUDA graph of several layers, the flag word zero after each; and (no
    timing) the compiled down that ran polls, reads the ids and issues every chosen expert's rows
    (top_k times the shared expert's loads) before its griddepcontrol.wait."""
    from omnistage.services.thinker.kernels import moe_one_token, pdl, ready_flag

    compiled: dict[tuple[bool, bool], object] = {}  # (IDS_SETTLED, IDS_FLAGGED) → the kernel that ran
    real = moe_one_token._one_token_down_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **constants):
                key = (constants["IDS_SETTLED"], constants["IDS_FLAGGED"])
                compiled[key] = real[grid](*args, **constants)

            return launch

    monkeypatch.setattr(moe_one_token, "_one_token_down_kernel", Recorded())
    layers, hidden = _layers(SHAPES[name], seed=len(name) + 1), SHAPES[name][0]
    x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    flag = ready_flag.flag_for(x.device)
    assert flag is ready_flag.flag_for(torch.device("cuda"))  # one word however the device is named
    residual = (torch.randn(1, hidden, device="cuda") * 2).to(torch.bfloat16)
    paths = {"today": _today, "after wait": _after_wait, "flagged": _selecting}
    want = _chain(_today, layers, x, residual)
    for key in ("after wait", "flagged"):
        got = _chain(paths[key], layers, x, residual)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), key
        assert flag.item() == 0, key
    graphs, outs = _captured(paths, layers, x, residual)
    for _ in range(3):  # new rows in place, each graph replayed on them
        _new_rows(x, residual)
        for key, graph in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            assert flag.item() == 0, key
        for key in ("after wait", "flagged"):
            assert all(torch.equal(a, b) for a, b in zip(outs[key], outs["today"], strict=True)), key
    if pdl.enabled(x.device):
        ptx = {key: kernel.asm["ptx"] for key, kernel in compiled.items()}
        flagged, after = (_loads_before_wait(ptx[False, f]) for f in (True, False))
        steps = [ptx[False, True].find(s) for s in ("ld.volatile.global", "atom.global.gpu.acquire.add")]
        steps += [ptx[False, True].find(s) for s in ("ld.global.cg", "griddepcontrol.wait")]
        assert steps[0] >= 0 and steps == sorted(steps), steps
        assert after > 0 and flagged >= (SHAPES[name][-1] + 1) * after, (flagged, after)


CFG = dict(block_size=16, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, kv_tokens=4096)


def test_the_tiny_engines_graph_tokens_are_the_same_with_the_switch_on_and_off(tiny_ckpt, monkeypatch):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = [[5, 99, 812, 17, 404, 3]]  # one sequence: every decode step one token

    def tokens() -> list[list[int]]:
        cfg = RankConfig(str(tiny_ckpt), EngineConfig(**CFG), dtype="bfloat16", device="cuda:0")
        engine = rank0_engine(start_rank(cfg))
        assert engine.runner.graphs is not None
        return [r.token_ids for r in engine.generate(prompt, params)]

    monkeypatch.setenv(GATEUP_SELECT_ENV, "off")
    want = tokens()
    monkeypatch.setenv(GATEUP_SELECT_ENV, "on")
    for flag in ("on", "off"):  # the down reading early on the ids-ready flag, or after its wait
        monkeypatch.setenv(DOWN_FLAG_ENV, flag)
        assert tokens() == want, flag
