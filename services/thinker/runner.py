"""ThinkerRunner: the thinker's device step — `LLMEngine.step` — and each request's stream of outputs.

Arrivals together are one batch: the device loop runs every add queued before a step (requests that
arrive while a step runs all join the next one), and an idle engine holds its first step, at most
`gather_s`, while requests are still on their way through the request flow (checked, tokenized): a
burst is prefilled in one step instead of its first request alone and the rest one step later. A
request alone never waits (nobody is on the way).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from omnistage.common.runtime.device_loop import DeviceFailed, DeviceRunner, call_in_loop
from omnistage.services.thinker.engine.budget import RequestBudget
from omnistage.services.thinker.engine.llm_engine import LLMEngine, RequestOutput
from omnistage.services.thinker.engine.media import Prompt, unpack_prompt
from omnistage.services.thinker.engine.sequence import SamplingParams

Stream = asyncio.Queue  # of RequestOutput, then maybe one BaseException (the loop failed or stopped)


class Arrival:
    """One request on its way to the engine; `here()` (once) when its add is queued or it was refused."""

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals: Arrivals | None = arrivals

    def here(self) -> None:
        arrivals, self._arrivals = self._arrivals, None
        if arrivals is not None:
            arrivals.count -= 1
            if not arrivals.count:  # a hold waiting for the last one ends now
                arrivals.wake()


class Arrivals:
    """The requests on their way to the engine's add: counted by the request flow (on the event loop)
    from its first look at a request until its add is queued or it is refused; read by the device
    thread. `wake` tells the device loop that one is no longer on its way."""

    def __init__(self) -> None:
        self.count = 0
        self.wake: Callable[[], None] = lambda: None

    @contextlib.contextmanager
    def coming(self) -> Iterator[Arrival]:
        """A request on its way for the block, or until its `here()`."""
        self.count += 1
        arrival = Arrival(self)
        try:
            yield arrival
        finally:
            arrival.here()


class ThinkerRunner(DeviceRunner):
    """The engine's requests and their streams; `add` / `abort` run on the device thread. `gather_s`:
    how long an idle engine holds its first step for the requests on their way (`arrivals`); 0: never."""

    def __init__(
        self,
        engine: LLMEngine,
        events: asyncio.AbstractEventLoop,
        gather_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.events = events  # the event loop the streams belong to
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()  # _streams and _ended: the device thread and fail_all both touch them
        self._ended: BaseException | None = None
        self.arrivals = Arrivals()
        self.gather_s = gather_s
        self._clock = clock
        self._held_since: float | None = None  # when an idle engine got its first request (device thread)

    # -- device thread, through DeviceLoop.call ------------------------------------------------------

    def add(
        self, request_id: str, prompt: Prompt, params: SamplingParams, budget: RequestBudget, stream: Stream
    ) -> None:
        """Add a request (token ids or a MultimodalPrompt) with the budget its flow computed; raises
        DeviceFailed when the streams have been ended meanwhile."""
        prompt_ids, extra = unpack_prompt(prompt)
        if not self.engine.has_unfinished():  # the first of what may be a burst: its step may wait
            self._held_since = self._clock()
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
        return self.engine.has_unfinished() and self._gathering() is None

    def wake_in(self) -> float | None:
        return self._gathering()

    def _gathering(self) -> float | None:
        """Seconds an idle engine's first step still waits for the requests on their way; None: it
        does not wait (nobody on the way, the hold is over, or the engine was not idle)."""
        if self._held_since is None or not self.arrivals.count:
            return None
        left = self._held_since + self.gather_s - self._clock()
        return left if left > 0 else None

    def step(self) -> int:
        self._held_since = None
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
