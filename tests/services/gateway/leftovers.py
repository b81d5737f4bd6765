"""What a test scenario leaves behind in its event loop: tasks still running, asyncio's reports of tasks
and generators left to the garbage collector, and the gateway's async generators nobody closed."""

from __future__ import annotations

import asyncio
import gc
import sys
from pathlib import Path

from omnistage.services.gateway import stages

from tests.services.gateway.gateway_speech_fakes import wait_until

GATEWAY_CODE = str(Path(stages.__file__).parent)  # the gateway's source folder


class Leftovers:
    """What a scenario leaves behind: tasks still running (besides those there when it began and the fake
    talker's server's), what asyncio reports to the loop's exception handler (tasks and generators
    left to the GC), and the gateway's async generators that nobody closed (asyncio's finalizer hook
    closes them when they are collected, in a task of its own, whenever that is)."""

    def __init__(self) -> None:
        self.reports: list[str] = []
        self.before = asyncio.all_tasks()
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._report)
        hooks = sys.get_asyncgen_hooks()

        def finalizer(agen) -> None:
            code = getattr(agen, "ag_code", None)
            if code is not None and GATEWAY_CODE in code.co_filename:
                self.reports.append(f"left to asyncio's finalizer: {code.co_qualname}")
            hooks.finalizer(agen)

        sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=finalizer)

    def _report(self, _loop: asyncio.AbstractEventLoop, context: dict) -> None:
        what = context.get("task") or context.get("future") or context.get("exception")
        self.reports.append(f"{context.get('message')}: {what!r}")

    def pending(self) -> list[str]:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() - self.before if t is not me and not t.done()]
        return [
            repr(t) for t in tasks if not getattr(t.get_coro(), "__qualname__", "").startswith("AioServer.")
        ]

    async def no_task_left(self) -> None:
        """Wait (bounded) until no task is left running; else fail naming them."""
        try:
            await wait_until(lambda: not self.pending(), what="no task left running")
        except AssertionError:
            raise AssertionError(f"tasks still running: {self.pending()}") from None

    async def collected(self) -> list[str]:
        """The reports once the GC has collected what nobody holds (and the async generators' finalizer
        tasks it started have run)."""
        for _ in range(3):
            gc.collect()
            for _ in range(20):
                await asyncio.sleep(0)
        return self.reports
