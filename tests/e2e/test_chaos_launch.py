"""Chaos launches of the real CPU pipeline (load_tests/chaos_launch.py): every start-up ends SERVING or
with the right diagnostic, and leaves nothing behind. How fast is the benchmark's question (bench/);
here only what happened and in what order, within the launch timeout."""

from __future__ import annotations

import socket
from collections import Counter

import pytest

from load_tests.chaos_launch import (
    ACTIONS,
    Plan,
    Result,
    Settings,
    _ephemeral_low,
    _judge,
    free_port_block,
    plan_launches,
    run_chaos,
    summary,
)

SEED = 20261122
LAUNCHES = 50
# Launches run in CI (each is a real pipeline start on 2 cores, ~10 s of CPU), picked from the seed's
# first ten: every fault action and a launcher's SIGTERM once, on both services, at TP 1 and 2, in
# every known phase (asserted below): #1 crash gateway warming_up, #4 oom thinker starting, #6 delay
# every gateway rank (ends serving), #8 hang thinker r0 loading_weights at TP 2 (its peer waits in the
# collective), #9 SIGTERM to the launcher. The other five repeat an action on the same paths; a crash
# of a non-zero thinker rank while loading weights is tests/e2e/test_serve_tp.py's own launch (with
# stricter checks of the report). The 1,000-launch run is a benchmark (bench/RESULTS.md).
CI_PLANS = (1, 4, 6, 8, 9)


def test_a_port_block_is_free_consecutive_and_below_the_ephemeral_range():
    """A thinker's dist_port reserves one port a rank: every port of the block binds, and none is one the
    kernel may hand a client connection meanwhile (CI 2026-11-29: `dist_port+1 ... is in use`)."""
    held = []
    try:
        for _ in range(3):  # the later blocks are picked while the earlier ones are held: each skips them
            base = free_port_block(4)
            assert 10000 <= base and base + 4 <= _ephemeral_low(), base
            for port in range(base, base + 4):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))  # raises if the block was not free
    finally:
        for s in held:
            s.close()


def test_free_ports_are_never_handed_out_twice_in_a_process(monkeypatch):
    """Calls one after another (a config's service port, then its admin port) get distinct ports even
    when the kernel picks a port it gave before: the owner skips those it handed out."""
    import load_tests.chaos_launch as chaos

    monkeypatch.setattr(chaos, "_HANDED_OUT", set())
    picks = iter([40001, 40001, 40003, 40001, 40003, 40005, 40003])
    real = socket.socket

    class Picked(real):
        def bind(self, address):
            super().bind((address[0], 0))  # bound for real (the close path), then reported as picked
            self.port = next(picks)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(chaos.socket, "socket", Picked)
    assert chaos.free_ports(1) == [40001]
    assert chaos.free_ports(2) == [40003, 40005]  # 40001 handed out, 40003, 40001, 40003 again, 40005
    with pytest.raises(RuntimeError, match="no 1 free ports"):
        chaos.free_ports(1, attempts=0)  # nothing left but ports handed out before


def test_plans_are_reproducible_and_cover_every_fault_kind():
    plans = plan_launches(LAUNCHES, SEED)
    assert plans == plan_launches(LAUNCHES, SEED) and plans != plan_launches(LAUNCHES, SEED + 1)
    kinds = Counter(p.kind for p in plans)
    assert set(ACTIONS) | {"none"} <= set(kinds), kinds
    assert kinds.keys() & {"sigkill", "launcher_sigterm", "launcher_sigkill"}, kinds
    assert {p.tp_size for p in plans} == {1, 2}
    assert {p.rank for p in plans if p.service == "thinker"} >= {-1, 0, 1}


def test_judge_rejects_a_diagnostic_that_names_the_wrong_rank():
    plan = Plan(0, 2, "crash", "thinker", "loading_weights", 1)
    err = (
        "03:00:00 thinker[r1] WARNING fault hook action=crash phase=loading_weights\n"
        "omnistage: start-up failed: thinker r0 exited with code 1: TPError\n"
        "thinker r0 loading_weights (1.0s ago) exited with code 1: TPError\n"
    )
    res = Result(plan, outcome="failed", exit_code=1)
    _judge(res, plan, err, "", {1: 100.0}, 101.0, Settings())
    assert res.fired == [1] and res.expected == "failed"
    assert any("no report line names thinker r1" in p for p in res.problems), res.problems
    good = err + "thinker r1 loading_weights (1.0s ago) exited with code 3\n"
    res = Result(plan, outcome="failed", exit_code=1)
    _judge(res, plan, good, "", {1: 100.0}, 101.0, Settings())
    assert res.ok, res.problems
    late = Result(plan, outcome="failed", exit_code=1)
    _judge(
        late, plan, good, "", {1: 100.0}, 100.0 + Settings().stop_grace_s + Settings().slack_s + 1, Settings()
    )
    assert any("from the fault to the exit" in p for p in late.problems)
    # CI: what happened and in what order, not how fast (2 loaded cores); the table keeps the times.
    untimed = Settings(timing_bounds=False)
    late = Result(plan, outcome="failed", exit_code=1)
    _judge(late, plan, good, "", {1: 100.0}, 100.0 + untimed.stop_grace_s + untimed.slack_s + 60, untimed)
    assert late.ok and late.diagnose_s > late.bound_s, late.problems
    early = Result(plan, outcome="failed", exit_code=1)
    _judge(early, plan, good, "", {1: 100.0}, 99.0, untimed)
    assert any("before the fault fired" in p for p in early.problems)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_launches_end_serving_or_diagnosed_and_leave_nothing(tmp_path, tiny_ckpt):
    lines: list[str] = []
    plans = [p for p in plan_launches(10, SEED) if p.index in CI_PLANS]
    assert set(ACTIONS) | {"launcher_sigterm"} <= {p.kind for p in plans}
    assert {p.tp_size for p in plans} == {1, 2} and {p.service for p in plans} >= {"thinker", "gateway"}
    assert {p.phase for p in plans} >= {"starting", "loading_weights", "warming_up"}
    results = run_chaos(
        plans, tiny_ckpt, tmp_path, Settings(hang_deadline_s=4.0, timing_bounds=False), log=lines.append
    )
    table = summary(results)
    print(table)
    assert len(results) == len(CI_PLANS)
    assert all(r.ok for r in results), "\n".join(lines) + "\n" + table
    outcomes = Counter(r.outcome for r in results)
    assert outcomes["serving"] and outcomes["failed"], outcomes  # both ends were really exercised
    assert not any(r.leftovers for r in results)
