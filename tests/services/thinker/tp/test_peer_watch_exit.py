"""When a PeerWatch ends its rank after a peer's failure: a rank whose own code has taken the failure
up (its collective broke) reports it and leaves on its own; only a rank still blocked in a collective
is ended after a short flush.

Seen on a loaded host: rank 0's gloo all-reduce broke only when the failed peer's process was gone,
its watch had ended it 1 s after noticing the failure, and the diagnostic rank 0's engine was
reporting never came out (the TP engine test waited for it until its timeout).
"""

from __future__ import annotations

import threading

from omnistage.common.config import TPConfig
from omnistage.services.thinker.tp.distributed import TPControl
from omnistage.services.thinker.tp.peer_watch import PeerWatch
from omnistage.services.thinker.tp.tp_store import GroupFailure

from tests.waits import wait_event

# A long exit budget (55 s) and its short flush (1 s): the rank's own path has far more than it needs.
CFG = TPConfig(peer_watch_interval_s=0.05, peer_timeout_s=5, failure_exit_s=60)
PEER_FAILED = GroupFailure(1, "rank 1 failed in step 3 forward: RuntimeError: injected fault")
BROKEN = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234")


class _Store:
    """The group's store as rank 0 reads it: rank 1 has reported its failure and read it."""

    def __init__(self) -> None:
        self.failure: GroupFailure | None = None

    def beat(self, rank: int) -> int:
        return 1

    def first_failure(self) -> GroupFailure | None:
        return self.failure

    def acknowledge(self) -> None:
        pass

    def acknowledgements(self) -> int:
        return 2

    def close(self) -> None:
        pass


def _rank0(events: list[str]) -> tuple[TPControl, _Store, threading.Event]:
    store = _Store()
    control = TPControl(0, 2, CFG, store=store)  # type: ignore[arg-type]
    exited = threading.Event()

    def exit_process(code: int) -> None:
        events.append(f"exit {code}")
        exited.set()

    control.watch = PeerWatch(control, exit_process)
    control.add_failure_listener(lambda failure: events.append("noticed"))
    return control, store, exited


def test_a_rank_whose_collective_broke_reports_the_failure_and_leaves_before_any_exit():
    events: list[str] = []
    control, store, exited = _rank0(events)
    noticed = threading.Event()
    control.add_failure_listener(lambda failure: noticed.set())
    control.watch.start()
    store.failure = PEER_FAILED
    wait_event(noticed, 30, "the watch to notice rank 1's failure", stage="thinker", rank=0)
    # The main path's all-reduce breaks (the peer's process is gone): it takes the failure up, then
    # takes longer than the short flush to report it (a loaded host), then leaves.
    failure = control.fail("step 3 forward", BROKEN)
    exited.wait(2 * min(1.0, control.exit_budget_s / 4))
    events.append(f"reported: {failure.message}")
    control.close()
    assert events == ["noticed", f"reported: {PEER_FAILED.message}"], events


def test_a_rank_still_blocked_in_a_collective_is_ended_after_the_short_flush():
    events: list[str] = []
    control, store, exited = _rank0(events)
    control.watch.start()
    store.failure = PEER_FAILED
    wait_event(exited, 30, "the watch to end rank 0", stage="thinker", rank=0)
    control.close()
    assert events == ["noticed", "exit 1"], events
