"""PeerWatch: one thread per TP rank that ends the rank when the group fails, whatever this rank's
other threads are blocked in."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

from omnistage.common.config import TPConfig
from omnistage.common.log import get_logger
from omnistage.services.thinker.tp.tp_store import (
    GroupFailure,
    GroupStore,
    PeerProcess,
    StoreLost,
    process_gone,
    this_process,
)

log = get_logger(__name__)


class WatchedRank(Protocol):
    """What the watch reads and calls of its rank's membership (distributed.TPControl)."""

    rank: int
    world_size: int
    cfg: TPConfig
    store: GroupStore | None
    leaving: bool
    failure: GroupFailure | None
    unwinding: bool

    @property
    def exit_budget_s(self) -> float: ...

    def report_peer(self, peer: int, kind: str, detail: str) -> GroupFailure: ...

    def store_lost(self, lost: StoreLost) -> GroupFailure: ...

    def notice(self, failure: GroupFailure) -> bool: ...

    def wait_for_acknowledgements(self, failure: GroupFailure, timeout_s: float) -> bool: ...


def exit_now(code: int = 1) -> None:
    """Leave the process without unwinding (a thread may be blocked inside a collective)."""
    logging.shutdown()
    os._exit(code)


class PeerWatch:
    """Heartbeats, peer liveness and the exit of one rank (owned by its TPControl)."""

    def __init__(self, control: WatchedRank, exit_process: Callable[[int], None] | None = None) -> None:
        self.control = control
        self.cfg = control.cfg
        self.exit_process = exit_process or exit_now
        self.peers = [r for r in range(control.world_size) if r != control.rank]
        self.me = this_process()
        self._processes: dict[int, PeerProcess] = {}
        self._seen: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"tp-peer-watch-rank{control.rank}", daemon=True
        )

    def start(self) -> None:
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in self.peers}
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """A failure is known on this rank: act on it now, not at the next tick."""
        self._wake.set()

    # --- checks ------------------------------------------------------------------------------

    def find_dead_peer(self) -> GroupFailure | None:
        """A peer whose process is gone from this host, reported as the group's failure; or None."""
        if self.control.leaving:
            return None
        try:
            for rank, proc in self._peer_processes().items():
                if proc.host == self.me.host and process_gone(proc.pid):
                    return self.control.report_peer(rank, "died", f"process {proc.pid} is gone")
        except StoreLost as lost:
            return self.control.store_lost(lost)
        return None

    def _find_silent_peer(self) -> GroupFailure | None:
        beats = self.control.store.beats(self.peers)  # type: ignore[union-attr]
        now = time.monotonic()
        silent = None
        for rank in self.peers:
            count, since = self._seen[rank]
            if beats[rank] != count:
                self._seen[rank] = (beats[rank], now)
            elif silent is None and now - since > self.cfg.peer_timeout_s:
                silent = (rank, now - since)
        if silent is None:
            return None
        rank, age = silent
        return self.control.report_peer(
            rank, "silent", f"no heartbeat for {age:.1f}s (tp.peer_timeout_s {self.cfg.peer_timeout_s:g})"
        )

    def _peer_processes(self) -> dict[int, PeerProcess]:
        missing = [r for r in self.peers if r not in self._processes]
        if missing:
            self._processes.update(self.control.store.processes(missing))  # type: ignore[union-attr]
        return self._processes

    def _check(self) -> GroupFailure | None:
        store = self.control.store
        try:
            store.beat(self.control.rank)  # type: ignore[union-attr]
            failure = store.first_failure()  # type: ignore[union-attr]
        except StoreLost as lost:
            return self.control.store_lost(lost)
        if failure is not None or self.control.leaving:
            return failure
        try:
            return self.find_dead_peer() or self._find_silent_peer()
        except StoreLost as lost:
            return self.control.store_lost(lost)

    # --- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        interval = self.cfg.peer_watch_interval_s
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            failure = self.control.failure
            if failure is None and not self.control.leaving:
                failure = self._check()
            if failure is not None and not self._stop.is_set():
                self._leave(failure)
                return

    def _leave(self, failure: GroupFailure) -> None:
        """Tell the listeners, let the others read the failure (store host), then give the rank's own
        path the time to leave (close() stops the watch); exit when it has not in time."""
        noticed = time.monotonic()
        self.control.notice(failure)
        budget = self.control.exit_budget_s
        if self.control.rank == 0:
            self.control.wait_for_acknowledgements(failure, budget / 2)
        if self._left_in_time(noticed + budget, min(1.0, budget / 4)):
            return
        log.error("rank %d exits: %s", self.control.rank, failure.message)
        self.exit_process(1)

    def _left_in_time(self, deadline: float, flush_s: float) -> bool:
        """Whether the rank left on its own (close() stopped the watch) before its exit is due.

        A rank whose own code has taken the failure up (`control.unwinding`: its own error, or a
        collective that broke) is reporting it: it gets until `deadline`, however slow a loaded host
        makes the report. One still blocked in a collective may be blocked for good: a short flush
        (status file, the statuses of failed requests, logs), extended to `deadline` when its
        collective breaks meanwhile."""
        flush_end = min(deadline, time.monotonic() + flush_s)
        while not self._stop.is_set():
            remaining = (deadline if self.control.unwinding else flush_end) - time.monotonic()
            if remaining <= 0:
                return False
            self._wake.wait(remaining)  # stop(), or the rank's own code taking the failure up
            self._wake.clear()
        return True
