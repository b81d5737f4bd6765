"""SIGTERM / SIGINT that reach `omnistage serve` before its launcher listens are kept, not fatal.

The CLI's imports, the config, the memory ledger and the preflight checks take a while (seconds on a
loaded host); a stop asked in that window used to end the process by the signal's default action
(exit -15). `defer()` runs first thing in the CLI for `serve` (stdlib only); the launcher `take()`s
what came when it installs its own handlers, and stops before starting anything.
"""

from __future__ import annotations

import signal
import threading

_early: list[int] = []


def _record(sig: int, frame: object) -> None:
    _early.append(sig)


def defer() -> None:
    """Record SIGTERM and SIGINT until the launcher's handlers replace these (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _record)


def take() -> int | None:
    """The first stop signal recorded so far (cleared), or None."""
    return _early.pop(0) if _early else None
