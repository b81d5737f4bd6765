"""Drain: a service refuses new stage RPCs and lets those in flight finish (Control's Drain, a stop);
Control's Resume undoes a drain it asked for, never one for a stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from omnistage.common.log import log_fields
from omnistage.common.runtime.calls import CallGuard
from omnistage.common.runtime.control import DRAIN_BY_CONTROL, RESUME_BY_CONTROL
from omnistage.common.runtime.errors import FailedPrecondition
from omnistage.common.runtime.phases import PhaseReporter

_log = logging.getLogger(__name__)

# Cancelled RPCs wait this long for their handlers to unwind after the drain deadline.
CANCEL_WAIT_S = 2.0


class Drain:
    """Whether the service drains (`active`) and who asked (`by`); `sync_health` follows it."""

    def __init__(
        self, name: str, calls: CallGuard, reporter: PhaseReporter, sync_health: Callable[[], Awaitable[None]]
    ) -> None:
        self.name, self.calls, self.reporter, self.sync_health = name, calls, reporter, sync_health
        self.active = False
        self.by = ""
        self._resumed = asyncio.Event()

    async def run(self, grace_s: float, by: str) -> tuple[int, int]:
        """Refuse new stage RPCs, wait up to `grace_s` for in-flight ones, cancel the rest (unless a
        Resume ends the wait first). Returns (completed during the drain, aborted)."""
        finished_before = self.calls.finished
        self.active, self.by = True, by
        self._resumed.clear()
        snap = self.reporter.snapshot()
        if snap.phase != "draining" or snap.detail != by:
            self.reporter.enter("draining", detail=by)
        await self.sync_health()
        if not await self._wait_idle_or_resumed(grace_s):
            return self.calls.finished - finished_before, 0
        aborted = self.calls.abort_all() if self.calls.calls else 0
        if aborted:
            log_fields(
                _log, logging.WARNING, "drain deadline passed, cancelling", requests=aborted, grace_s=grace_s
            )
            await self._wait_idle_or_resumed(CANCEL_WAIT_S)
        return self.calls.finished - finished_before, aborted

    def resume(self, stopping: str) -> None:
        """Serve again after a drain by Control; `stopping`: why the service stops ('' when it does not)."""
        if stopping:
            raise FailedPrecondition(
                f"{self.name} is stopping ({self.by or stopping}); a stop cannot be resumed"
            )
        if not self.active:
            raise FailedPrecondition(f"{self.name} is not draining (phase {self.reporter.phase})")
        if self.by != DRAIN_BY_CONTROL:
            raise FailedPrecondition(f"{self.name} drains for '{self.by}', which Resume cannot undo")
        self.active = False
        self._resumed.set()
        self.reporter.enter("serving", detail=RESUME_BY_CONTROL)

    async def _wait_idle_or_resumed(self, timeout_s: float) -> bool:
        """Wait until no stage RPC runs or a Resume came; False when resumed."""
        waits = [asyncio.ensure_future(self.calls.idle.wait()), asyncio.ensure_future(self._resumed.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self.active
