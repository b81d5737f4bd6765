"""Blocking start-up work (weights, profiling, warm-up) off the event loop, in daemon threads.

Daemon threads, so that a stop never waits for a load to finish. But a process must not then run
the interpreter's finalization under them: torch's C++ state is torn down while the thread still
uses it ("terminate called without an active exception", exit by SIGABRT). `stage_main` never
finalizes: it runs the exit handlers and ends with `os._exit` (naming what `busy()` still runs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_threads: set[threading.Thread] = set()
_lock = threading.Lock()


def in_daemon_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Run `fn()` in a daemon thread named `name`; await the returned future for its result."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            fut.set_exception(exc)
        finally:
            with _lock:
                _threads.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _lock:
        _threads.add(thread)
    thread.start()
    return asyncio.wrap_future(fut)


def busy() -> list[str]:
    """Names of the blocking threads still running (a stop came in the middle of their work)."""
    with _lock:
        return sorted(t.name for t in _threads if t.is_alive())
