"""Blocking start-up work (weights, profiling, warm-up) off the event loop, in daemon threads.

Daemon threads, so that a stop never waits for a load to finish. But a process must not then run
the interpreter's finalization under them: torch's C++ state is torn down while the thread still
uses it ("terminate called without an active exception", exit by SIGABRT). `stage_main` never
finalizes: it runs the exit handlers and ends with `os._exit` (naming what `busy()` still runs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_threads: set[threading.Thread] = set()
_lock = threading.Lock()


def with_this_threads_device(fn: Callable[[], T]) -> Callable[[], T]:
    """`fn` for another thread, run on the CUDA device current in this one. The current device is
    per thread (a new thread starts on cuda:0): a rank on cuda:1 whose work runs in a thread of its
    own otherwise computes on tensors of cuda:1 with cuda:0 current (Triton: "Pointer argument
    cannot be accessed from Triton")."""
    torch = sys.modules.get("torch")  # no CUDA state before torch is imported: nothing to carry
    if torch is None or not torch.cuda.is_initialized():
        return fn
    device = torch.cuda.current_device()

    def on_device() -> T:
        torch.cuda.set_device(device)
        return fn()

    return on_device


def in_daemon_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Run `fn()` in a daemon thread named `name`, on this thread's CUDA device; await the returned
    future for its result."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fn = with_this_threads_device(fn)

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
