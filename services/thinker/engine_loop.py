"""The bridge between the asyncio gRPC server and the engine, which one thread drives.

`LLMEngine` is not thread-safe: every call into it (add, abort, step) runs on the engine thread.
The server submits commands through a queue and gets results back as futures; each request's
outputs go to its own asyncio queue. The engine never waits on a reader (no blocking send in a
loop that must also drain): outputs are handed over with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from omnistage.services.thinker.engine.distributed import TPError
from omnistage.services.thinker.engine.llm_engine import LLMEngine, RequestOutput
from omnistage.services.thinker.engine.media import Prompt, unpack_prompt
from omnistage.services.thinker.engine.sequence import SamplingParams

_log = logging.getLogger(__name__)


class EngineFailed(RuntimeError):
    """The engine can serve no more (a TP rank failed, died or stopped answering; a forward raised);
    every request gets this, its message the group's first failure (`rank 2 died while ...`)."""


class EngineLoop:
    """Owns the engine thread; `submit` / `abort` / `call` are safe from any thread."""

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, idle_poll_s: float = 0.5) -> None:
        self.engine = engine
        self.loop = loop
        self.idle_poll_s = idle_poll_s
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # _streams and failure: the engine thread and fail() both touch them
        self.failure: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # --- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.failure is not None:
            fut.set_exception(EngineFailed(str(self.failure)))
            return fut
        self._commands.put((fn, fut))
        if self.failure is not None:  # failed while we queued: nobody else will drain it
            self._fail_pending(self.failure)
        return fut

    async def submit(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        """Add a request (token ids or a MultimodalPrompt); raises what add_request raises (bad
        request, queue full)."""
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        prompt_ids, extra = unpack_prompt(prompt)

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt_ids, params, **extra)
            with self._lock:
                if self.failure is not None:
                    raise EngineFailed(str(self.failure))
                self._streams[request_id] = stream

        await asyncio.wrap_future(self.call(add))
        return stream

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """End a request now; its stream gets a final ABORT output. The future holds that output, or
        None when the request is unknown or already finished."""

        def run(engine: LLMEngine) -> RequestOutput | None:
            out = engine.abort(request_id)
            with self._lock:
                stream = self._streams.pop(request_id, None)
            if out is not None and stream is not None:
                self.loop.call_soon_threadsafe(stream.put_nowait, out)
            return out

        return self.call(run)

    def load(self) -> tuple[int, int]:
        """(running, waiting) as last seen; read without the engine lock, so approximate."""
        sched = self.engine.scheduler
        return len(sched.running), len(sched.waiting)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the current step. After a failure the engine thread may be blocked in a
        collective for good: it is not waited for (the process is leaving)."""
        self._stop.set()
        self._commands.put((lambda engine: None, concurrent.futures.Future()))
        self._thread.join(1.0 if self.failure is not None else timeout_s)
        if self._thread.is_alive() and self.failure is None:
            _log.error("engine loop did not stop within %.0fs", timeout_s)

    def fail(self, exc: BaseException) -> bool:
        """From any thread: end every request with EngineFailed(exc) now and refuse new ones, even
        while the engine thread is blocked (a TP peer died inside a collective). False if failed already."""
        with self._lock:
            if self.failure is not None:
                return False
            self.failure = exc
            streams = list(self._streams.values())
            self._streams.clear()
        failed = exc if isinstance(exc, EngineFailed) else EngineFailed(str(exc))
        for stream in streams:
            self.loop.call_soon_threadsafe(stream.put_nowait, failed)
        self._fail_pending(exc)
        self._stop.set()
        self._commands.put((lambda engine: None, concurrent.futures.Future()))  # wake an idle engine thread
        if self.on_failure is not None:
            self.on_failure(exc)
        return True

    # --- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
                else:
                    self.engine.keepalive()
        except BaseException as exc:  # noqa: BLE001 - every request must hear about it
            if isinstance(exc, TPError):  # the group's failure: its diagnostic says it all
                _log.error("engine loop stops: %s", exc)
            else:
                _log.exception("engine loop failed")
            self.fail(exc)
        finally:
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort on the way out
                _log.exception("engine shutdown failed")

    def _drain_commands(self, block: bool) -> None:
        try:
            fn, fut = self._commands.get(timeout=self.idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineFailed(str(exc)))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted while the step ran, or failed meanwhile
                if out.finished:
                    del self._streams[out.request_id]
                self.loop.call_soon_threadsafe(stream.put_nowait, out)
