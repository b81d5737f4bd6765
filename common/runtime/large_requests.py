"""Large requests are walked (wire_bounds.py) and decoded off the event loop, a bounded amount of
walking at once.

grpc.aio deserializes on the event loop. Walking a request's records is Python, ~0.1 s for 100 k of
them: 120 such requests at once held the gateway's loop 9.6 s (issue 43), its health went unanswered
and the launcher took it for hung. So a request of at least `handlers.OFF_LOOP_BYTES` is only
wrapped there; it is walked and decoded here, on a thread of our own (one: more would only take
the GIL from the loop more often; the walk lets the GIL go every few thousand records), while the
loop goes on answering health, beating and taking small requests.

The work waiting is bounded by what it may cost: a request's walk is at most `min(bytes / 2,
max_records)` records (a record is at least two bytes; bytes fields are skipped by their length),
and at most `max_records` of those (about a second of walk) and `max_bytes` of raw requests are in
the walk at once; a lone request always is. The estimate is an upper bound (a packed field of
450,000 token ids is a few records, walked in a millisecond), so a unary request past it waits up to
`ROOM_WAIT_S` for room (cheap walks make room fast) and only then is RESOURCE_EXHAUSTED, with a retry
hint of how long the walks ahead take at the measured pace; a stream's next message (its call
admitted already) waits for room as long as it takes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.errors import Overloaded
from omnistage.common.runtime.handlers import Received

# Records in the walk at once (estimated from the requests' sizes): four requests at the record
# budget, about a second of walking; and their raw bytes.
DEFAULT_MAX_RECORDS = 400_000
DEFAULT_MAX_BYTES = 64 << 20
# The longest a unary request waits for room before it is refused.
ROOM_WAIT_S = 1.0
_MIN_RETRY_MS = 100


class LargeRequests:
    """The walks and decodes of one server's large requests (one per CallGuard)."""

    def __init__(
        self, service: str, max_records: int = DEFAULT_MAX_RECORDS, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        self.service = service
        self.max_records, self.max_bytes = max_records, max_bytes
        self.in_walk = 0
        self.records_in_walk = 0
        self.bytes_in_walk = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, f"{service}-decode")
        self._room = asyncio.Condition()
        self._s_per_record = 2e-6  # measured as walks finish; a first guess until then

    def retry_after_ms(self) -> int:
        """About how long the walks now in the queue take."""
        return max(_MIN_RETRY_MS, int(1000 * self.records_in_walk * self._s_per_record))

    def _has_room(self, received: Received) -> bool:
        return not self.in_walk or (
            self.records_in_walk + received.cost <= self.max_records
            and self.bytes_in_walk + received.nbytes <= self.max_bytes
        )

    async def decoded(self, received: Received, *, wait: bool) -> Received:
        """`received` walked and decoded in a thread; past the bound: Overloaded, or (`wait`) a wait
        for room."""
        assert received.later is not None
        if not self._has_room(received):
            try:
                async with self._room:
                    await within(
                        self._room.wait_for(lambda: self._has_room(received)), None if wait else ROOM_WAIT_S
                    )
            except TimeoutError:
                raise Overloaded(
                    f"{self.service}: {self.in_walk} large requests ({self.bytes_in_walk / 2**20:.1f} MiB, "
                    f"up to {self.records_in_walk} protobuf fields) are being decoded, at most "
                    f"{self.max_records} fields at once: retry",
                    retry_after_ms=self.retry_after_ms(),
                    reason="decode_full",
                ) from None
        self.in_walk += 1
        self.records_in_walk += received.cost
        self.bytes_in_walk += received.nbytes
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._timed, received)
        finally:
            self.in_walk -= 1
            self.records_in_walk -= received.cost
            self.bytes_in_walk -= received.nbytes
            async with self._room:
                self._room.notify_all()

    def _timed(self, received: Received) -> Received:
        """(On the pool's thread.) The walk and decode, timed: a moving average of their pace."""
        assert received.later is not None
        started = time.monotonic()
        try:
            return received.later()
        finally:
            elapsed = time.monotonic() - started
            if elapsed > 0.01 and received.cost:  # long enough to measure
                self._s_per_record = 0.8 * self._s_per_record + 0.2 * (elapsed / received.cost)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
