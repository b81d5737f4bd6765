"""A rank's blocking work and its device loop run in threads of their own; each must compute on the
rank's CUDA device, not on cuda:0 where a new thread starts (a TP=2 thinker's rank 1 failed its first
real step with Triton's "Pointer argument cannot be accessed" when its plan loop ran on cuda:0)."""

from __future__ import annotations

import asyncio
import sys
import threading
import types

from omnistage.common.runtime.blocking import in_daemon_thread
from omnistage.common.runtime.device_loop import DeviceLoop, DeviceRunner


class _PerThreadCuda:
    """torch.cuda's current device as CUDA keeps it: per thread, 0 in a new thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, index: int) -> None:
        self._local.device = index


def _fake_torch(monkeypatch) -> _PerThreadCuda:
    cuda = _PerThreadCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    return cuda


def test_blocking_work_runs_on_the_callers_device(monkeypatch):
    cuda = _fake_torch(monkeypatch)

    async def scenario() -> tuple[int, int]:
        cuda.set_device(1)  # the rank's device, set on the event loop's thread by the boot
        seen = await in_daemon_thread(cuda.current_device, "rank-work")
        bare = await asyncio.to_thread(cuda.current_device)  # a thread nobody told
        return seen, bare

    seen, bare = asyncio.run(scenario())
    assert bare == 0, "the fake must start new threads on device 0, as CUDA does"
    assert seen == 1


class _Idle(DeviceRunner):
    def has_work(self) -> bool:
        return False

    def step(self) -> int:  # pragma: no cover - no work is queued
        raise AssertionError

    def fail_all(self, error: BaseException) -> None:
        pass


def test_the_device_loop_runs_on_the_device_current_where_it_was_made(monkeypatch):
    cuda = _fake_torch(monkeypatch)
    cuda.set_device(1)
    loop = DeviceLoop("thinker", _Idle())
    loop.start()
    try:
        assert loop.call(cuda.current_device).result(timeout=30) == 1
    finally:
        loop.stop()
