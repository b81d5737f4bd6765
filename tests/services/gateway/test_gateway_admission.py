"""Admission by capacity: the excess of a burst is refused at once, what is admitted can finish in time.

Completions are driven by the test (an event per request), so nothing here depends on how fast the
machine is: the gate's service time is set as if measured.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from omnistage.common.runtime.errors import DeadlineExceeded, Overloaded
from omnistage.services.gateway.admission import GateConfig, StageGate, check_path


async def _burst(gate: StageGate, n: int, deadline_s: float):
    """`n` requests arriving at once; each holds its slot until the test sets its event."""
    done = [asyncio.Event() for _ in range(n)]
    admitted: list[int] = []

    async def one(i: int) -> str:
        try:
            async with gate.slot(deadline_s):
                admitted.append(i)
                await done[i].wait()
            return "ok"
        except Overloaded as exc:
            assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.retry_after_ms > 0
            return "refused"
        except DeadlineExceeded:
            return "deadline"

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await asyncio.sleep(0)  # every arrival is judged before anything finishes
    return tasks, done, admitted


def test_a_burst_four_times_capacity_refuses_the_excess_at_once_and_admitted_ones_finish():
    async def main():
        gate = StageGate("thinker", GateConfig(max_running=2, max_waiting=100))
        gate.service_s = 3.0  # measured: one request holds a slot 3 s
        # Deadline 10 s: the running 2 plus two waves of waiters (wait 3 s / 6 s, + 3 s service) fit.
        tasks, done, admitted = await _burst(gate, 8, 10.0)
        refused = [t for t in tasks if t.done()]
        assert len(refused) == 2 and all(t.result() == "refused" for t in refused)
        assert gate.running == 2 and gate.waiting == 4 and len(admitted) == 2
        for i in range(8):  # completions in FIFO order admit the waiters
            done[i].set()
            await asyncio.sleep(0)
        results = await asyncio.gather(*tasks)
        assert results.count("ok") == 6 and results.count("refused") == 2
        assert gate.running == 0 and gate.waiting == 0 and gate.refused == 2
        assert sorted(admitted) == admitted[:2] + sorted(admitted[2:])  # FIFO

    asyncio.run(main())


def test_a_full_waiting_room_refuses_whatever_the_deadline():
    async def main():
        gate = StageGate("talker", GateConfig(max_running=1, max_waiting=2))
        tasks, done, _ = await _burst(gate, 5, 1e6)
        assert [t.result() for t in tasks if t.done()] == ["refused", "refused"]
        for ev in done:
            ev.set()
        assert (await asyncio.gather(*tasks)).count("ok") == 3

    asyncio.run(main())


def test_work_that_lost_its_slot_waits_ahead_of_every_waiter_even_in_a_full_waiting_room():
    """A spoken answer whose talker replica went down: its speech takes the next stream first."""

    async def main():
        gate = StageGate("talker", GateConfig(max_running=1, max_waiting=2))
        tasks, done, admitted = await _burst(gate, 3, 1e6)  # one running, two waiting: the room is full
        moved = asyncio.create_task(gate.take(1e6, first=True))
        await asyncio.sleep(0)
        assert not moved.done() and gate.waiting == 3  # not refused for the waiting room
        done[0].set()
        slot = await moved  # the freed slot is the moved work's, before waiters 1 and 2
        assert admitted == [0] and gate.running == 1
        slot.release()
        for ev in done:
            ev.set()
        assert await asyncio.gather(*tasks) == ["ok"] * 3 and admitted == [0, 1, 2]

    asyncio.run(main())


def test_an_idle_stage_admits_a_request_whose_deadline_is_shorter_than_the_mean_service():
    async def main():
        gate = StageGate("imagegen", GateConfig(max_running=1))
        gate.service_s = 30.0
        gate.check(0.5)  # nothing ahead: the stage may still make it; never refused idle
        async with gate.slot(0.5):
            assert gate.running == 1

    asyncio.run(main())


def test_a_waiter_whose_deadline_passes_leaves_the_queue_and_frees_nothing_it_did_not_hold():
    async def main():
        gate = StageGate("thinker", GateConfig(max_running=1))
        gate.service_s = 0.01  # as measured: the waiter is admitted, then its own deadline passes
        hold = asyncio.Event()

        async def holder():
            async with gate.slot(None):
                await hold.wait()

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        with pytest.raises(DeadlineExceeded):
            async with gate.slot(0.05):
                pass
        assert gate.waiting == 0 and gate.running == 1
        hold.set()
        await first
        assert gate.running == 0

    asyncio.run(main())


def test_a_cancelled_waiter_hands_a_slot_it_was_just_given_to_the_next():
    async def main():
        gate = StageGate("thinker", GateConfig(max_running=1))
        tasks, done, admitted = await _burst(gate, 3, None)
        assert admitted == [0] and gate.waiting == 2
        done[0].set()  # the slot goes to waiter 1 ...
        tasks[1].cancel()  # ... which leaves before it runs: waiter 2 must get it
        await asyncio.sleep(0.01)
        assert admitted[-1] == 2 and gate.running == 1
        done[2].set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert gate.running == 0 and gate.waiting == 0

    asyncio.run(main())


def test_a_request_whose_wait_and_service_do_not_fit_its_deadline_is_refused_with_the_wait_as_hint():
    async def main():
        gate = StageGate("thinker", GateConfig(max_running=1))
        gate.service_s = 2.0
        async with gate.slot(None):
            assert gate.check(4.5) == pytest.approx(2.0, abs=0.1)  # 2 s wait + 2 s service fit
            with pytest.raises(Overloaded) as refused:
                gate.check(3.5)
            assert "exceeds the 3.5s left to the deadline" in str(refused.value)
            assert 1900 <= refused.value.retry_after_ms <= 2000 and gate.refused == 1

    asyncio.run(main())


def test_a_capacity_read_again_after_a_restart_admits_the_waiters():
    async def main():
        gate = StageGate("talker", GateConfig(max_running=1))
        tasks, done, admitted = await _burst(gate, 3, None)
        gate.set_capacity(3)
        await asyncio.sleep(0.01)
        assert sorted(admitted) == [0, 1, 2] and gate.running == 3
        for ev in done:
            ev.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_request_is_judged_over_every_gated_stage_of_its_path():
    """Encoder, thinker and image stage one after another: a wait at one of them counts with the
    service time of all of them; the stage that makes it wait longest is named."""
    encoder = StageGate("encoder", GateConfig(max_running=1, max_waiting=4))
    thinker = StageGate("thinker", GateConfig(max_running=1, max_waiting=4))
    imagegen = StageGate("imagegen", GateConfig(max_running=1, max_waiting=1))
    encoder.service_s, thinker.service_s, imagegen.service_s = 1.0, 2.0, 4.0
    check_path([encoder, thinker, imagegen], 5.0)  # every stage free: admitted, whatever its deadline
    imagegen.running = 1  # the image stage busy: wait 4 s, then 1 + 2 + 4 s of service = 11 s
    check_path([encoder, thinker, imagegen], 12.0)
    check_path([encoder, thinker], 1.0)  # a text request does not pass the image stage
    with pytest.raises(
        Overloaded,
        match=r"^imagegen: at capacity .* wait 4\.0s plus 4\.0s of service \(and 3\.0s at "
        r"the other stages of its path\) exceeds the 10\.0s left",
    ) as err:
        check_path([encoder, thinker, imagegen], 10.0)
    assert err.value.reason == "imagegen_deadline" and err.value.retry_after_ms == 4000

    async def full_waiting_room() -> None:
        imagegen._waiters.append(asyncio.get_running_loop().create_future())  # its waiting room (1) is full
        with pytest.raises(
            Overloaded,
            match=r"^imagegen: 1 requests waiting, the most that may wait for it \(1 running of 1\)",
        ) as err:
            check_path([encoder, thinker, imagegen], None)
        assert err.value.reason == "imagegen_queue_full"
        check_path([encoder, thinker], None)

    asyncio.run(full_waiting_room())
