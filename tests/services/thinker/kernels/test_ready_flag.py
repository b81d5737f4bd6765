"""The down launch reading the selecting gate-up's ids and its chosen rows before its PDL wait on the
ids-ready flag (`kernels/ready_flag.py`, `moe_one_token` IDS_FLAGGED; issue 40): its output is the
bits of the down that reads them after its wait (IDS_SETTLED=False) and of today's launches, with the
flag seen by every program, never seen (the poll's bound spent), and seen over stale ids (the real
ones stored only at the wait), and the flag word is zero after every launch. Under the interpreter
the programs run one after another: the gate-up has always raised the flag before the down's first
program polls, so the other cases are made by hand."""

from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.kernels import moe_one_token, ready_flag
from omnistage.services.thinker.kernels.moe_one_token import RouterLogits, selecting_experts
from omnistage.services.thinker.kernels.router import normed_logits

from tests.services.thinker.kernels.test_gate_up_select import SHAPES, _layer, _today


def _flagged(p, flag: bool):
    top_k, groups, kept, scaling = p["route"]
    logits, normed, _ = normed_logits(*p["row"], p["gate"], p["bias"], groups, kept, top_k)
    select = RouterLogits(logits, p["bias"], groups, kept, top_k, scaling)
    return selecting_experts(normed, *p["experts"], select, p["shared"], flag=flag)


def _word(p) -> int:
    return int(ready_flag.flag_for(p["row"][0].device).item())


class _Polls:
    """Records each down program's poll: (seen, last), and runs `before` first (each program's)."""

    def __init__(self, monkeypatch, before=lambda: None) -> None:
        self.seen: list[bool] = []
        self.last: list[bool] = []
        real = moe_one_token.poll_flag

        def poll(flag_ptr, polls):
            before()
            seen, last = real(flag_ptr, polls)
            self.seen.append(bool(seen.handle.data))
            self.last.append(bool(last.handle.data))
            return seen, last

        monkeypatch.setattr(moe_one_token, "poll_flag", poll)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_with_the_flag_seen_the_down_is_the_after_the_wait_downs_bit_for_bit(name, dtype, monkeypatch):
    p = _layer(SHAPES[name], dtype, seed=11)
    want_w, want_ids, want, _ = _today(p)
    after_wait = _flagged(p, flag=False)
    polls = _Polls(monkeypatch)
    got = _flagged(p, flag=True)
    assert polls.seen and all(polls.seen)  # every program read its rows before its wait
    assert polls.last == [False] * (len(polls.last) - 1) + [True]  # one last ticket: the last program
    assert _word(p) == 0
    for a, b in zip(got, after_wait, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[0], want) and torch.equal(got[1], want_w) and torch.equal(got[2], want_ids)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_flag_never_raised_spends_the_polls_and_changes_no_bit(name, monkeypatch):
    """A gate-up that does not raise the flag: each program polls its bound out, reads its rows
    after its wait; the word (tickets only) is zero after the launch."""
    p = _layer(SHAPES[name], torch.bfloat16, seed=12)
    want = _flagged(p, flag=False)
    raised: list[int] = []
    monkeypatch.setattr(moe_one_token, "raise_flag", lambda flag_ptr: raised.append(1))
    monkeypatch.setattr(ready_flag, "POLLS", 3)
    polls = _Polls(monkeypatch)
    got = _flagged(p, flag=True)
    assert raised == [1] and polls.seen and not any(polls.seen) and polls.last[-1]
    assert _word(p) == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _stale_ids(real: torch.Tensor, experts: int) -> torch.Tensor:
    """Other experts' ids where the real ones are: slot 0 the same (kept), slot 1 past the experts
    and slot 2 negative (garbage: no early read), the rest another expert each."""
    stale = (real + 1) % experts
    stale[0], stale[1], stale[2] = real[0], 2**40 + 3, -5
    return stale


@pytest.mark.parametrize("seen_by_gate_up", [True, False], ids=["raised", "left-over"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_flag_over_stale_ids_changes_no_bit(name, seen_by_gate_up, monkeypatch):
    """Every down program polls the flag set over stale ids and routing weights (its own gate-up's
    flag, or a word left 1 by no gate-up of this launch), and sees the real ones only at its wait
    (the hook stores them then); the output is the after-the-wait down's, and the word zero."""
    p = _layer(SHAPES[name], torch.bfloat16, seed=13)
    want = _flagged(p, flag=False)
    experts = p["experts"][1].shape[0]
    buffers: dict[str, torch.Tensor] = {}
    real_down, real_wait = moe_one_token._down, moe_one_token.wait_for_prior_kernels

    def down(h, w2, shared, ids, routing, out, tiles, settled, flag=None):
        buffers.update(ids=ids, routing=routing, real_ids=ids.clone(), real_routing=routing.clone())
        if not seen_by_gate_up:
            flag.fill_(1)  # a left-over flag, over a gate-up that raised none
        monkeypatch.setattr(moe_one_token, "wait_for_prior_kernels", waiting)
        real_down(h, w2, shared, ids, routing, out, tiles, settled, flag)
        monkeypatch.setattr(moe_one_token, "wait_for_prior_kernels", real_wait)

    def staling():  # each program's poll, before the wait
        buffers["ids"].copy_(_stale_ids(buffers["real_ids"], experts))
        buffers["routing"].fill_(float("nan"))

    def waiting(use_pdl):
        buffers["ids"].copy_(buffers["real_ids"])
        buffers["routing"].copy_(buffers["real_routing"])
        return real_wait(use_pdl)

    monkeypatch.setattr(moe_one_token, "_down", down)
    if not seen_by_gate_up:
        monkeypatch.setattr(moe_one_token, "raise_flag", lambda flag_ptr: None)
    polls = _Polls(monkeypatch, staling)
    got = _flagged(p, flag=True)
    assert polls.seen and all(polls.seen) and _word(p) == 0
    assert not got[0].isnan().any()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_flag_word_is_one_per_device_and_zeroed():
    cpu = torch.device("cpu")
    word = ready_flag.flag_for(cpu)
    assert word is ready_flag.flag_for(cpu) and word.dtype == torch.int32 and word.tolist() == [0]
