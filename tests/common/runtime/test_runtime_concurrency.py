"""One admission shape for every stage (`ConcurrencyLimiter.admit`): a full waiting room is refused at
once, a wait past the stage's queue timeout is RESOURCE_EXHAUSTED with pushback, a wait past the
request's own deadline is DEADLINE_EXCEEDED; a slot given back wakes the next waiter."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from omnistage.common.runtime.concurrency import ConcurrencyLimiter
from omnistage.common.runtime.errors import DeadlineExceeded, Overloaded


async def _hold(limiter: ConcurrencyLimiter, release: asyncio.Event) -> None:
    async with limiter.admit(math.inf, 60.0):
        await release.wait()


def test_a_full_waiting_room_is_refused_at_once_naming_its_key():
    async def main() -> None:
        limiter = ConcurrencyLimiter("stage x", 1, max_waiting=1, waiting_key="x.max_queued_requests")
        release = asyncio.Event()
        holders = [asyncio.create_task(_hold(limiter, release)) for _ in range(2)]
        while limiter.waiting < 1:
            await asyncio.sleep(0)
        assert (limiter.in_use, limiter.waiting) == (1, 1)
        with pytest.raises(
            Overloaded, match=r"^stage x: 1 running and 1 waiting \(x.max_queued_requests\)$"
        ) as err:
            async with limiter.admit(math.inf, 60.0, retry_after_ms=700):
                pass
        assert err.value.retry_after_ms == 700
        release.set()
        await asyncio.gather(*holders)
        assert (limiter.in_use, limiter.waiting, limiter.peak_in_use) == (0, 0, 1)

    asyncio.run(main())


def test_the_queue_timeout_is_pushback_and_the_deadline_is_deadline_exceeded():
    async def main() -> None:
        limiter = ConcurrencyLimiter("stage y", 1)
        release = asyncio.Event()
        holder = asyncio.create_task(_hold(limiter, release))
        while limiter.in_use < 1:
            await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="^stage y: no free batch slot within 0.05s"):
            async with limiter.admit(math.inf, 0.05, what="a y slot"):
                pass
        with pytest.raises(DeadlineExceeded, match="^stage y: deadline passed waiting for a y slot$"):
            async with limiter.admit(time.monotonic() + 0.05, 60.0, what="a y slot"):
                pass
        with pytest.raises(DeadlineExceeded, match="^stage y: deadline passed before a y slot$"):
            async with limiter.admit(time.monotonic() - 1, 60.0, what="a y slot"):
                pass
        assert limiter.waiting == 0
        release.set()
        await holder
        async with limiter.admit(math.inf, 0.05):  # free again: admitted at once
            assert limiter.in_use == 1
        assert limiter.in_use == 0

    asyncio.run(main())


def test_an_error_inside_the_slot_is_the_callers_and_gives_the_slot_back():
    async def main() -> None:
        limiter = ConcurrencyLimiter("stage z", 1)
        with pytest.raises(TimeoutError, match="the body's own"):
            async with limiter.admit(math.inf, 1.0):
                raise TimeoutError("the body's own")
        assert limiter.in_use == 0

    asyncio.run(main())
