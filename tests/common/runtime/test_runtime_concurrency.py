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


async def _hold_units(limiter: ConcurrencyLimiter, units: int, release: asyncio.Event, order: list) -> None:
    async with limiter.admit(math.inf, 60.0, units=units):
        order.append(units)
        await release.wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_units_are_granted_first_come_first_served_and_a_large_waiter_is_never_passed():
    async def main() -> None:
        limiter = ConcurrencyLimiter("stage u", 10, unit="frames")
        first, rest = asyncio.Event(), asyncio.Event()
        order: list[int] = []
        holder = asyncio.create_task(_hold_units(limiter, 6, first, order))
        await _settle()
        big = asyncio.create_task(_hold_units(limiter, 8, rest, order))  # 6 + 8 > 10: waits
        await _settle()
        small = asyncio.create_task(_hold_units(limiter, 2, rest, order))  # would fit, but comes after
        await _settle()
        assert (order, limiter.in_use, limiter.waiting) == ([6], 6, 2)
        first.set()
        await holder
        await _settle()
        assert (order, limiter.in_use, limiter.waiting) == ([6, 8, 2], 10, 0)  # both fit once 6 left
        rest.set()
        await asyncio.gather(big, small)
        assert (limiter.in_use, limiter.peak_in_use) == (0, 10)

    asyncio.run(main())


def test_a_waiter_that_times_out_or_is_cancelled_lets_the_ones_behind_it_go():
    async def main() -> None:
        limiter = ConcurrencyLimiter("stage v", 10, unit="frames")
        release, order = asyncio.Event(), []
        holder = asyncio.create_task(_hold_units(limiter, 4, release, order))
        await _settle()
        with pytest.raises(Overloaded, match=r"^stage v: no free batch slot within 0.05s \(4/10 frames busy"):
            async with limiter.admit(math.inf, 0.05, units=9):
                pass
        blocked = asyncio.create_task(_hold_units(limiter, 9, release, order))
        await _settle()
        behind = asyncio.create_task(_hold_units(limiter, 3, release, order))
        await _settle()
        assert order == [4]  # 3 would fit but waits behind the 9
        blocked.cancel()
        await _settle()
        assert order == [4, 3] and limiter.in_use == 7 and limiter.waiting == 0
        release.set()
        await asyncio.gather(holder, behind)
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert limiter.in_use == 0

    asyncio.run(main())


def test_more_units_than_the_limit_are_a_callers_error():
    limiter = ConcurrencyLimiter("stage w", 4)

    async def ask() -> None:
        async with limiter.admit(math.inf, 1.0, units=5):
            pass

    with pytest.raises(ValueError, match="5 units asked of a limit of 4"):
        asyncio.run(ask())
    assert (limiter.in_use, limiter.waiting) == (0, 0)
