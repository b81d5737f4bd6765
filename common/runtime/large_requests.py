"""Large requests are walked (wire_bounds.py) and decoded off the event loop, a bounded number of
bytes at once.

grpc.aio deserializes on the event loop. Walking a request's records is Python, ~0.1 s for 100 k of
them: 120 such requests at once held the gateway's loop 9.6 s, its health went unanswered and the
launcher took it for hung. So a request of at least `OFF_LOOP_BYTES` is only wrapped there
(handlers.py) and walked and decoded here, in threads, while the loop goes on answering health, the
heartbeat and small requests. At most `max_bytes` of them are in the walk at once (a lone request
always is): a unary request past that is RESOURCE_EXHAUSTED at arrival, with a retry hint of how
long the bytes ahead take; a stream's next message waits for room (its call was admitted already).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

from omnistage.common.runtime.errors import Overloaded
from omnistage.common.runtime.handlers import Received

# Large requests' bytes in the walk at once: ~2 s of walking at the measured rate, far above any
# legitimate burst of text requests (a 1.8 MB body is 450,000 token ids).
DEFAULT_MAX_BYTES = 64 << 20
_THREADS = 2
_MIN_RETRY_MS = 100


class LargeRequests:
    """The walks and decodes of one server's large requests (one per CallGuard)."""

    def __init__(self, service: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.service = service
        self.max_bytes = max_bytes
        self.bytes_in_walk = 0
        self.in_walk = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(_THREADS, f"{service}-decode")
        self._room = asyncio.Condition()
        self._bytes_per_s = 20e6  # measured as walks finish; a first guess until then

    def retry_after_ms(self) -> int:
        """About how long the bytes in the walk now take to walk."""
        return max(_MIN_RETRY_MS, int(1000 * self.bytes_in_walk / self._bytes_per_s))

    async def decoded(self, received: Received, *, wait: bool) -> Received:
        """`received` walked and decoded in a thread; past the bound: Overloaded, or (`wait`) a wait
        for room."""
        assert received.later is not None
        n = received.nbytes
        if self.in_walk and self.bytes_in_walk + n > self.max_bytes:
            if not wait:
                raise Overloaded(
                    f"{self.service}: {self.in_walk} large requests ({self.bytes_in_walk / 2**20:.1f} MiB) "
                    f"are being decoded, at most {self.max_bytes / 2**20:.0f} MiB at once: retry",
                    retry_after_ms=self.retry_after_ms(),
                    reason="decode_full",
                )
            async with self._room:
                await self._room.wait_for(
                    lambda: not self.in_walk or self.bytes_in_walk + n <= self.max_bytes
                )
        self.in_walk += 1
        self.bytes_in_walk += n
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._timed, received)
        finally:
            self.in_walk -= 1
            self.bytes_in_walk -= n
            async with self._room:
                self._room.notify_all()

    def _timed(self, received: Received) -> Received:
        """(In a pool thread.) The walk and decode, timed: a moving average of their speed."""
        assert received.later is not None
        started = time.monotonic()
        try:
            return received.later()
        finally:
            elapsed = time.monotonic() - started
            if elapsed > 0.01:  # long enough to measure
                self._bytes_per_s = 0.8 * self._bytes_per_s + 0.2 * (received.nbytes / elapsed)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
