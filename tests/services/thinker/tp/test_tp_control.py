"""The TP group's control plane without a model: store calls that cannot hang, dead processes seen at
once, and collectives that give up at the serving deadline (not a start-up phase's)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from omnistage.common.config import TPConfig
from omnistage.services.thinker.tp.distributed import TPError, join_tp_group
from omnistage.services.thinker.tp.tp_store import GroupFailure, GroupStore, StoreLost, process_gone

from tests.services.thinker.group.local_ranks import free_port
from tests.waits import wait_event, wait_for

STORE_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=True, timeout=timedelta(seconds=30),
                      wait_for_workers=False)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture(autouse=True)
def leave_the_group():
    """Tests that join a TP group in this process leave it (one default process group per process)."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def store_host():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield port, proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_the_first_failure_wins_and_every_rank_reads_it(store_host):
    port, _ = store_host
    a, b = GroupStore("127.0.0.1", port, timeout_s=5), GroupStore("127.0.0.1", port, timeout_s=5)
    first = a.report(GroupFailure(2, "rank 2 failed in warming_up: OutOfMemoryError: x"))
    second = b.report(GroupFailure(1, "rank 1 failed in warming_up: RuntimeError: y"))
    assert (
        first
        == second
        == b.first_failure()
        == GroupFailure(2, "rank 2 failed in warming_up: OutOfMemoryError: x")
    )


def test_a_stopped_store_host_is_a_failure_within_the_deadline_not_a_hang(store_host):
    port, proc = store_host
    store = GroupStore("127.0.0.1", port, timeout_s=1.0)
    store.beat(1)
    os.kill(proc.pid, signal.SIGSTOP)
    with pytest.raises(StoreLost, match="no reply within 1s") as err:  # the call's own deadline ended it
        store.first_failure()
    assert err.value.silent
    with pytest.raises(StoreLost):  # and it stays lost: no second wait
        store.beat(1)


def test_a_store_host_that_is_gone_is_a_failure_at_once(store_host):
    port, proc = store_host
    store = GroupStore("127.0.0.1", port, timeout_s=10.0)
    store.beat(1)
    proc.kill()
    proc.wait(10)
    with pytest.raises(StoreLost) as err:
        store.beat(1)
    # At once: the broken connection ended the call, not its 10 s deadline (which would be `silent`).
    assert not err.value.silent and "no reply within" not in str(err.value), err.value


def test_a_dead_process_is_gone_even_before_it_is_reaped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert not process_gone(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    # A zombie until we reap it below.
    wait_for(
        lambda: process_gone(proc.pid), 10, "a killed process to look gone before it is reaped", poll_s=0.05
    )
    proc.wait(10)
    assert process_gone(proc.pid)


# --- the serving deadline of collectives -------------------------------------------------------

TP = TPConfig(
    startup_collective_timeout_s=60,
    serving_collective_timeout_s=2,
    failure_exit_s=30,
    peer_watch_interval_s=0.2,
    peer_timeout_s=20,
)


def _idle_peer(port: int) -> None:
    """Rank 1: joins, keeps its heartbeat going, and never enters the collective rank 0 waits in."""
    control = join_tp_group(1, 2, port=port, cfg=TP)
    control.enter_serving()
    time.sleep(60)


def test_a_collective_while_serving_gives_up_at_the_serving_deadline(tmp_path):
    port = free_port()
    peer = mp.get_context("spawn").Process(target=_idle_peer, args=(port,), daemon=True)
    peer.start()
    try:
        control = join_tp_group(0, 2, port=port, cfg=TP)
        control.watch.exit_process = lambda code: None  # this test process must survive the failure
        seen = []
        control.add_failure_listener(seen.append)
        control.enter_serving()
        with pytest.raises(TPError, match=r"rank 0 failed in agreeing while serving: RuntimeError") as err:
            control.agree_min(1, "agreeing while serving")
    finally:
        peer.kill()
        peer.join(10)
    # The deadline that fired is the serving one (gloo names it: 2000ms), not the start-up one (60000ms).
    assert f"Timed out waiting {TP.serving_collective_timeout_s * 1000:g}ms" in str(err.value), err.value
    assert seen == [err.value.failure]


def _store_host(port: int, ready) -> None:
    """Rank 0: hosts the store, joins, then waits to be killed."""
    join_tp_group(0, 2, port=port, cfg=replace(TP, peer_timeout_s=5, failure_exit_s=30))
    ready.set()
    time.sleep(120)


def test_the_store_host_dying_ends_the_other_ranks_naming_it():
    """Rank 0 hosts the store: when it dies first the others can read no diagnostic, so its loss is
    itself the failure (the TP=4 outage: ranks 1 and 3 waited forever once rank 0 had left)."""
    ctx = mp.get_context("spawn")
    port, ready = free_port(), ctx.Event()
    host = ctx.Process(target=_store_host, args=(port, ready), daemon=True)
    host.start()
    try:
        control = join_tp_group(1, 2, port=port, cfg=replace(TP, peer_timeout_s=5, failure_exit_s=30))
        events = []  # what the rank did, in order: noticed the failure (its listeners), then left
        control.add_failure_listener(lambda failure: events.append(("noticed", failure)))
        control.watch.exit_process = lambda code: events.append(("exit", code))
        wait_event(ready, 60, "rank 0 to host the store", stage="thinker", rank=0)
        host.kill()
        wait_for(
            lambda: ("exit", 1) in events,
            control.cfg.failure_exit_s,
            "rank 1 to leave once the store host died",
            stage="thinker",
            rank=1,
            poll_s=0.05,
        )
    finally:
        host.kill()
        host.join(10)
    # The loss was noticed as such (the connection gone, not a store call's deadline), blamed on rank 0,
    # and the rank left because of it (a rank that left without noticing would have named nobody).
    assert [what for what, _ in events] == ["noticed", "exit"], events
    (_, failure), (_, code) = events
    assert code == 1
    assert failure.rank == 0 and failure.kind == "store_lost", failure
    assert failure.message.startswith("rank 0 (store host) is gone while start-up"), failure


# --- who is blamed --------------------------------------------------------------------------------


class _PeerDiesLate:
    """A watch that finds rank 3's process gone only on its `found_on`-th look: a SIGKILLed peer
    closes its sockets (this rank's all-reduce breaks) before its process is gone."""

    def __init__(self, control, found_on: int) -> None:
        self.control, self.found_on, self.looks = control, found_on, 0

    def find_dead_peer(self):
        self.looks += 1
        return (
            self.control.report_peer(3, "died", "process 4242 is gone")
            if self.looks >= self.found_on
            else None
        )

    def wake(self) -> None:
        pass


def test_a_forward_broken_by_a_dead_peer_blames_the_peer_not_the_rank_that_noticed():
    from omnistage.services.thinker.tp.distributed import TPControl

    cfg = TPConfig(peer_watch_interval_s=0.02, peer_timeout_s=5, failure_exit_s=30)
    control = TPControl(2, 4, cfg)
    control.watch = _PeerDiesLate(control, found_on=6)
    control.serving, control.num_plans = True, 13
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234"
    )
    failure = control.fail("step 12 forward", gloo)  # as llm_engine / worker report a failed forward
    assert failure == GroupFailure(3, "rank 3 died while serving (step 13): process 4242 is gone", "died")
    assert control.watch.looks == 6


def test_a_forward_that_fails_on_its_own_blames_its_rank_at_once():
    from omnistage.services.thinker.tp.distributed import TPControl

    control = TPControl(2, 4, TPConfig(peer_watch_interval_s=0.02, peer_timeout_s=5, failure_exit_s=30))
    control.watch = _PeerDiesLate(control, found_on=10**9)
    failure = control.fail("step 12 forward", ValueError("shape mismatch"))
    assert (
        failure.rank == 2
        and failure.message == "rank 2 failed in step 12 forward: ValueError: shape mismatch"
    )
    assert control.watch.looks == 1  # no wait for a culprit


# --- step plans: one broadcast when they fit, two when not -------------------------------------------------


def _plan_receiver(port: int, out) -> None:
    """Rank 1: receives plans until the exit plan; hands back each plan's arrays and the messages."""
    control = join_tp_group(1, 2, port=port, cfg=TP)
    control.enter_serving()
    got = []
    while True:
        plan = control.broadcast_plan()
        got.append(
            (int(plan.kind), plan.input_ids.tolist(), plan.block_tables.tolist(), plan.sample_rows.tolist())
        )
        if plan.kind.name == "EXIT":
            break
    out.put((got, control.plan_messages))


def test_a_plan_that_fits_is_one_broadcast_and_a_large_one_arrives_whole_in_two():
    import torch
    from omnistage.services.thinker.tp.distributed import PLAN_INLINE_INT64S
    from omnistage.services.thinker.tp.plan import StepPlan

    def plan(tokens: int, width: int) -> StepPlan:
        return StepPlan(
            input_ids=torch.arange(tokens),
            positions=torch.arange(tokens).repeat(3, 1),
            query_lens=torch.tensor([tokens]),
            context_lens=torch.tensor([tokens]),
            slot_mapping=torch.arange(tokens),
            block_tables=torch.arange(width).view(1, width),
            sample_rows=torch.tensor([tokens - 1]),
        )

    small, large = plan(1, 40), plan(PLAN_INLINE_INT64S, 300)  # a decode step's; a long prefill chunk's
    assert small.encode().numel() < PLAN_INLINE_INT64S < large.encode().numel()
    port, ctx = free_port(), mp.get_context("spawn")
    out = ctx.Queue()
    peer = ctx.Process(target=_plan_receiver, args=(port, out), daemon=True)
    peer.start()
    try:
        control = join_tp_group(0, 2, port=port, cfg=TP)
        control.watch.exit_process = lambda code: None
        control.enter_serving()
        for p in (small, large, small, StepPlan.exit()):
            control.broadcast_plan(p)
        got, messages = out.get(timeout=60)
    finally:
        peer.join(30)
        if peer.is_alive():
            peer.kill()
    want = [
        (int(p.kind), p.input_ids.tolist(), p.block_tables.tolist(), p.sample_rows.tolist())
        for p in (small, large, small, StepPlan.exit())
    ]
    assert got == want
    assert messages == control.plan_messages == 5  # 1 + 2 + 1 + 1
