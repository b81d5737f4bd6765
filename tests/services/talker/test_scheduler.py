"""The talker's step scheduler with a fake clock: streams bounded by slots (memory), not by the step
batch; each step takes the due streams earliest deadline first; none starves; a cancel frees its slot
at the next step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omnistage.services.talker.pacing import StreamPace
from omnistage.services.talker.scheduler import SegmentJob, StreamScheduler

RATE = 1000  # samples per second of the fake streams
STEP = 100  # samples one step makes (0.1 s)


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def new_job(name: str, lead_s: float | None = None) -> SegmentJob:
    pace = StreamPace(lead_s, RATE) if lead_s is not None else None
    job = SegmentJob(None, None, 1000, None, lambda event: None, pace=pace)  # type: ignore[arg-type]
    job.name = name  # type: ignore[attr-defined]
    return job


def run_step(sched: StreamScheduler, clock: Clock) -> list[str]:
    """One pick, then what the runner does: prefill the new, advance each stepped job's audio."""
    pick = sched.pick()
    for job in pick.new:
        job.history = torch.zeros(1)
    for job in pick.batch:
        job.steps += 1
        if job.pace is not None:
            job.pace.advance(STEP, clock.now)
    return [j.name for j in pick.batch]  # type: ignore[attr-defined]


def test_streams_are_bounded_by_slots_and_each_step_by_the_step_batch():
    clock = Clock()
    sched = StreamScheduler(slots=8, step_batch=3, clock=clock)
    jobs = [new_job(f"s{i}") for i in range(10)]
    for job in jobs:
        sched.put(job)
    first = run_step(sched, clock)
    assert first == ["s0", "s1", "s2"]  # first audio in arrival order, three rows at most
    assert sched.free_slots == 0 and sched.jobs_queued == 2  # eight hold a slot, two wait for one
    seen = set(first)
    for _ in range(3):
        clock.now += 0.01
        batch = run_step(sched, clock)
        assert len(batch) == 3
        seen |= set(batch)
    assert seen == {f"s{i}" for i in range(8)}  # every stream with a slot got its first step
    sched.release(jobs[0])
    run_step(sched, clock)
    assert sched.jobs_queued == 1 and jobs[8].slot >= 0  # a freed slot goes to the first waiting


def test_a_new_stream_goes_before_paced_streams_that_still_have_audio():
    clock = Clock()
    sched = StreamScheduler(slots=4, step_batch=2, clock=clock)
    a, b = new_job("a", lead_s=0.5), new_job("b", lead_s=0.5)
    sched.put(a)
    sched.put(b)
    while sched.has_work():  # both race to their lead, then wait for their listeners
        run_step(sched, clock)
    clock.now += 0.3  # both due again, 0.2 s of audio still unheard (deadline in 0.2 s)
    c = new_job("c", lead_s=0.5)
    sched.put(c)  # its first audio was asked for now: more urgent than audio due in 0.2 s
    assert run_step(sched, clock)[0] == "c"


def test_a_stream_whose_audio_ran_out_goes_first():
    clock = Clock()
    sched = StreamScheduler(slots=4, step_batch=1, clock=clock)
    a = new_job("a", lead_s=0.2)
    sched.put(a)
    while sched.has_work():
        run_step(sched, clock)
    clock.now += 5.0  # a's listener ran out of audio long ago (an underrun)
    b = new_job("b", lead_s=0.2)
    sched.put(b)  # asked for after a's audio ran out
    order = []
    while "b" not in order:
        clock.now += 0.001
        order += run_step(sched, clock)
    # earliest deadline first: a until its listener's audio runs past the moment b was asked for
    assert set(order[:-1]) == {"a"} and len(order) > 1
    assert a.pace.runs_out_at() >= b.queued - 0.1


def test_a_paced_stream_ahead_of_its_listener_is_not_stepped_and_the_loop_knows_when_to_wake():
    clock = Clock()
    sched = StreamScheduler(slots=2, step_batch=2, clock=clock)
    a = new_job("a", lead_s=0.3)
    sched.put(a)
    steps = 0
    while sched.has_work():
        run_step(sched, clock)
        steps += 1
    assert steps == 3 and a.pace.ahead_s(clock.now) == pytest.approx(0.3)
    assert sched.pick().batch == [] and sched.wake_in() == pytest.approx(0.0)
    clock.now += 0.15
    assert sched.has_work() and run_step(sched, clock) == ["a"]  # 0.25 s ahead: still under its lead
    assert run_step(sched, clock) == ["a"] and not sched.has_work()  # 0.35 s ahead
    assert sched.wake_in() == pytest.approx(0.05)


def test_unpaced_streams_take_turns_when_more_are_due_than_a_step_holds():
    clock = Clock()
    sched = StreamScheduler(slots=5, step_batch=2, clock=clock)
    for i in range(5):
        sched.put(new_job(f"s{i}"))
    counts: dict[str, int] = {}
    for _ in range(10):
        clock.now += 0.01
        for name in run_step(sched, clock):
            counts[name] = counts.get(name, 0) + 1
    assert counts == {f"s{i}": 4 for i in range(5)}  # 20 rows over 5 streams: round robin


def test_nearly_due_paced_streams_fill_the_room_a_step_has():
    clock = Clock()
    sched = StreamScheduler(slots=3, step_batch=3, clock=clock)
    a, b = new_job("a", lead_s=0.2), new_job("b", lead_s=0.2)
    sched.put(a)
    run_step(sched, clock)
    clock.now += 0.05
    sched.put(b)
    batch = run_step(sched, clock)  # b's first step; a (0.05 s ahead, under its lead) is due too
    assert batch == ["b", "a"]
    while sched.has_work():
        run_step(sched, clock)
    b.pace.advance(STEP, clock.now)  # b a step further ahead than a
    clock.now += 0.09  # a: due again; b: ahead by less than twice its lead, so it joins a's step
    assert a.pace.due(clock.now) and not b.pace.due(clock.now) and b.pace.may_join(clock.now)
    assert sorted(run_step(sched, clock)) == ["a", "b"]


def test_a_cancelled_stream_frees_its_slot_at_the_next_pick():
    clock = Clock()
    sched = StreamScheduler(slots=1, step_batch=1, clock=clock)
    a, b = new_job("a"), new_job("b")
    sched.put(a)
    sched.put(b)
    assert run_step(sched, clock) == ["a"]
    a.cancelled = True
    assert run_step(sched, clock) == ["b"]  # a's slot went to b at this very pick
    assert a.history is None and sched.jobs_in_flight == 1


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(1, 12),
    step_batch=st.integers(1, 6),
    arrivals=st.lists(st.tuples(st.integers(0, 20), st.booleans(), st.integers(1, 30)), max_size=25),
)
def test_no_step_exceeds_its_batch_and_every_stream_finishes(slots, step_batch, arrivals):
    clock = Clock()
    sched = StreamScheduler(slots=slots, step_batch=step_batch, clock=clock)
    jobs = []
    for when, paced, length in sorted(arrivals):
        job = new_job(f"j{len(jobs)}", lead_s=0.3 if paced else None)
        job.max_steps = length
        jobs.append((when, job))
    pending, done = list(jobs), set()
    for tick in range(20000):
        clock.now += 0.02
        while pending and pending[0][0] <= tick:
            sched.put(pending.pop(0)[1])
        pick = sched.pick()
        assert len(pick.batch) <= min(step_batch, slots)
        assert len({j.slot for j in pick.batch}) == len(pick.batch)  # one row per slot
        for job in pick.new:
            job.history = torch.zeros(1)
        for job in pick.batch:
            job.steps += 1
            if job.pace is not None:
                job.pace.advance(STEP, clock.now)
            if job.steps >= job.max_steps:
                sched.release(job)
                done.add(id(job))
        if not pending and len(done) == len(jobs):
            break
    assert len(done) == len(jobs)
