"""Every wait has a deadline, and its timeout names what, stage, rank and phase."""

from __future__ import annotations

import asyncio

import pytest
from omnistage.common.runtime.deadlines import Deadline, cancel_and_wait, within


def test_deadline_remaining_shrinks():
    d = Deadline(10)
    assert 0 < d.remaining() <= 10 and not d.expired()
    assert Deadline(0).expired()


def test_within_returns_the_result_or_times_out():
    async def scenario():
        assert await within(asyncio.sleep(0, "done"), 5) == "done"
        assert await within(asyncio.sleep(0, "unbounded"), None) == "unbounded"
        with pytest.raises(TimeoutError):
            await within(asyncio.Event().wait(), 0.01)

    asyncio.run(scenario())


def test_a_cancel_that_arrives_as_the_wait_ends_stops_the_task():
    """The awaited event fires and the waiting task is cancelled in the same loop turn: the task must
    end cancelled (asyncio.wait_for on 3.11 returned and the task went on)."""

    async def scenario():
        event, went_on = asyncio.Event(), []

        async def waiter() -> None:
            await within(event.wait(), 5)
            went_on.append(True)

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # the task waits for the event now
        event.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return task.cancelled(), went_on

    assert asyncio.run(scenario()) == (True, [])


def test_cancel_and_wait_names_a_task_that_ignores_its_cancellation(caplog):
    async def scenario():
        stop = asyncio.Event()

        async def stubborn() -> None:
            while not stop.is_set():
                try:
                    await stop.wait()
                except asyncio.CancelledError:
                    pass  # ignored: the owner must not wait for it forever

        polite = asyncio.create_task(asyncio.Event().wait(), name="polite")
        task = asyncio.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        left = await cancel_and_wait([polite, task], 0.05, "answer r1")
        stop.set()
        await task
        return polite.cancelled(), [t.get_name() for t in left]

    assert asyncio.run(scenario()) == (True, ["stubborn"])
    assert "answer r1: 1 task(s) still running 0.05s after their cancellation: stubborn" in caplog.text
