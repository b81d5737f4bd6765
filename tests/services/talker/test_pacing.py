"""Real-time pacing: a paced stream is stepped only while its audio is less than its lead ahead of a
listener (fake clock), joins steps others take while nearly due, and the device loop wakes for it."""

from __future__ import annotations

import pytest
from omnistage.common.runtime.device_loop import DeviceLoop
from omnistage.services.talker.model_runner import TalkerRunner
from omnistage.services.talker.pacing import StreamPace
from omnistage.services.talker.runner import SegmentRunner

from tests.services.talker.talker_jobs import job


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def paced(talker_models):
    clock = Clock()
    runner = SegmentRunner(TalkerRunner(talker_models, 3, 256, 640), clock=clock)
    step_s = talker_models.config.samples_per_step / talker_models.config.vae.sample_rate
    return runner, clock, step_s


def test_a_paced_stream_waits_for_its_listener_and_goes_on_when_due(talker_models, voices, paced):
    runner, clock, step_s = paced
    lead = 2.5 * step_s
    j, rec = job(talker_models, voices, max_steps=40)
    j.pace = StreamPace(lead, talker_models.config.vae.sample_rate)
    runner.put(j)
    ahead_before = []
    while runner.has_work():
        ahead_before.append(j.pace.ahead_s(clock.now))
        assert runner.step() == 1
    # the clock stands still: it raced only while less than the lead ahead, then stopped
    assert len(ahead_before) >= 2 and all(a < lead for a in ahead_before)
    ahead = j.pace.ahead_s(clock.now)
    assert ahead >= lead and j.steps == len(ahead_before) < 40
    assert runner.step() == 0  # not due: nothing stepped
    assert runner.wake_in() == pytest.approx(ahead - lead)
    clock.now += runner.wake_in()  # the listener caught up to the lead: due again
    assert runner.has_work() and runner.step() == 1
    steps = j.steps
    clock.now += 10 * step_s  # a long wait: it catches up, step by step, and stops at the lead again
    while runner.has_work():
        runner.step()
    assert steps < j.steps < 40 and rec.done is None and j.pace.ahead_s(clock.now) >= lead


def test_an_unpaced_stream_steps_every_time_and_a_nearly_due_one_joins_it(talker_models, voices, paced):
    runner, clock, step_s = paced
    lead = 2 * step_s
    fast, _ = job(talker_models, voices, seed=1, max_steps=30)
    slow, _ = job(talker_models, voices, seed=2, max_steps=30)
    slow.pace = StreamPace(lead, talker_models.config.vae.sample_rate)
    runner.put(fast)
    runner.put(slow)
    stepped = []
    for _ in range(10):
        joins = slow.pace.ahead_s(clock.now) < 2 * lead  # due, or nearly: it shares the step
        stepped.append((runner.step(), joins))
    assert all(n == 1 + joins for n, joins in stepped)
    assert {n for n, _ in stepped} == {1, 2}  # both: with it while nearly due, without it after
    assert fast.steps == 10 and slow.steps < 10
    clock.now += 10 * step_s
    assert runner.step() == 2  # due again: back in the batch


def test_the_device_loop_wakes_for_a_paced_job_without_being_told(talker_models, voices):
    pace = StreamPace(0.05, talker_models.config.vae.sample_rate)
    runner = SegmentRunner(TalkerRunner(talker_models, 1, 256, 640))
    loop = DeviceLoop("pacing", runner, idle_wait_s=60.0)  # only wake_in can end its waits early
    j, rec = job(talker_models, voices, max_steps=4)
    j.pace = pace
    loop.start()
    try:
        loop.admit(lambda: runner.put(j))
        from tests.waits import wait_for

        wait_for(lambda: rec.done is not None, 30, "the paced job to finish")
    finally:
        loop.stop()
    assert rec.done.steps == 4
