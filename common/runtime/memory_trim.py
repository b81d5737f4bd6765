"""Give the memory of large requests back to the operating system."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import sys
import time
from collections.abc import Callable

_log = logging.getLogger(__name__)

# A request at least this large (serialized bytes) makes a trim worth its cost.
LARGE_REQUEST_BYTES = 4 << 20


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc; musl has none
    return None


class MemoryTrimmer:
    """Schedules `malloc_trim(0)` after large requests: rate-limited, off the event loop."""

    def __init__(
        self, *, large_bytes: int = LARGE_REQUEST_BYTES, min_interval_s: float = 10.0, delay_s: float = 0.5
    ) -> None:
        self.large_bytes = large_bytes
        self.min_interval_s = min_interval_s
        self.delay_s = delay_s
        self.runs = 0
        self._trim = _malloc_trim()
        self._last = float("-inf")
        self._pending: asyncio.TimerHandle | None = None

    def request_done(self, nbytes: int) -> None:
        """A request of `nbytes` has been handled (on the event loop): trim soon if it was large."""
        if self._trim is None or nbytes < self.large_bytes or self._pending is not None:
            return
        loop = asyncio.get_running_loop()
        # After the delay grpc has let go of the call; never sooner than min_interval_s after the last run.
        at = max(time.monotonic() + self.delay_s, self._last + self.min_interval_s)
        self._pending = loop.call_later(at - time.monotonic(), lambda: loop.create_task(self._run()))

    async def _run(self) -> None:
        self._pending = None
        self._last = time.monotonic()
        self.runs += 1
        try:
            await asyncio.to_thread(self._release)
        except Exception:  # noqa: BLE001 - trimming is best effort, never the cause of a failure
            _log.exception("memory trim failed")

    def _release(self) -> None:
        assert self._trim is not None
        before = _rss_bytes()
        self._trim(0)
        _log.debug(
            "malloc_trim after a large request: RSS %.0f -> %.0f MiB", before / 2**20, _rss_bytes() / 2**20
        )

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
