"""ThinkerRunner: the thinker's device step — `LLMEngine.step` — and each request's stream of outputs."""

from __future__ import annotations

import asyncio
import threading

from omnistage.common.runtime.device_loop import DeviceFailed, DeviceRunner, call_in_loop
from omnistage.services.thinker.engine.budget import RequestBudget
from omnistage.services.thinker.engine.llm_engine import LLMEngine, RequestOutput
from omnistage.services.thinker.engine.media import Prompt, unpack_prompt
from omnistage.services.thinker.engine.sequence import SamplingParams

Stream = asyncio.Queue  # of RequestOutput, then maybe one BaseException (the loop failed or stopped)


class ThinkerRunner(DeviceRunner):
    """The engine's requests and their streams; `add` / `abort` run on the device thread."""

    def __init__(self, engine: LLMEngine, events: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.events = events  # the event loop the streams belong to
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()  # _streams and _ended: the device thread and fail_all both touch them
        self._ended: BaseException | None = None

    # -- device thread, through DeviceLoop.call ------------------------------------------------------

    def add(
        self, request_id: str, prompt: Prompt, params: SamplingParams, budget: RequestBudget, stream: Stream
    ) -> None:
        """Add a request (token ids or a MultimodalPrompt) with the budget its flow computed; raises
        DeviceFailed when the streams have been ended meanwhile."""
        prompt_ids, extra = unpack_prompt(prompt)
        self.engine.add_request(request_id, prompt_ids, params, budget, **extra)
        with self._lock:
            if self._ended is not None:
                raise DeviceFailed(str(self._ended))
            self._streams[request_id] = stream

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now; its stream gets a final ABORT output. Returns that output, or None when
        the request is unknown or already finished."""
        out = self.engine.abort(request_id)
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if out is not None and stream is not None:
            call_in_loop(self.events, stream.put_nowait, out)
        return out

    # -- any thread ----------------------------------------------------------------------------------

    def load(self) -> tuple[int, int]:
        """(running, waiting) as last seen; read without the engine's thread, so approximate."""
        sched = self.engine.scheduler
        return len(sched.running), len(sched.waiting)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            if self._ended is None:
                self._ended = error
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            call_in_loop(self.events, stream.put_nowait, error)

    # -- device thread -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> int:
        outputs = self.engine.step()
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted while the step ran, or failed meanwhile
                if out.finished:
                    del self._streams[out.request_id]
                call_in_loop(self.events, stream.put_nowait, out)
        return len(outputs)

    def idle(self) -> None:
        self.engine.keepalive()

    def close(self) -> None:
        self.engine.shutdown()
