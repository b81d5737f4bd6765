"""DeviceLoop: steps, calls between steps, failure that ends every job, stop that ends what is held."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from omnistage.common.runtime.device_loop import DeviceFailed, DeviceLoop, DeviceRunner, DeviceStopped

WAIT_S = 30.0  # a bound on waits that should end at once, never an assertion about speed


class Jobs(DeviceRunner):
    """A runner whose jobs are futures, stepped all at once; records what the device thread did."""

    def __init__(self, step_error: BaseException | None = None, hold: threading.Event | None = None) -> None:
        self.lock = threading.Lock()
        self.queued: list[tuple[str, concurrent.futures.Future]] = []
        self.active: list[tuple[str, concurrent.futures.Future]] = []
        self.events: list[str] = []
        self.step_error = step_error
        self.hold = hold  # the step waits for this: a step in progress the test controls
        self.in_step = threading.Event()
        self.idled = threading.Event()

    def put(self, name: str) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.queued.append((name, fut))
        return fut

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.queued)

    def step(self) -> int:
        with self.lock:
            self.active, self.queued = self.queued, []
        self.in_step.set()
        if self.hold is not None:
            assert self.hold.wait(WAIT_S)
        if self.step_error is not None:
            raise self.step_error
        with self.lock:  # what fail_all took meanwhile has had its answer
            batch, self.active = self.active, []
        self.events.append("step " + ",".join(name for name, _ in batch))
        for name, fut in batch:
            fut.set_result(name.upper())
        return len(batch)

    def fail_all(self, error: BaseException) -> None:
        with self.lock:
            batch = self.active + self.queued
            self.active, self.queued = [], []
        self.events.append(f"fail_all {type(error).__name__} {len(batch)}")
        for _, fut in batch:
            fut.set_exception(error)

    def idle(self) -> None:
        self.idled.set()

    def close(self) -> None:
        self.events.append("close")


def test_admitted_jobs_are_stepped_and_hooks_hear_each_step():
    runner = Jobs()
    loop = DeviceLoop("t", runner, idle_wait_s=0.01)
    seen: list[int] = []
    loop.on_step.append(lambda n, seconds: seen.append(n) if seconds >= 0 else None)
    loop.start()
    try:
        a = loop.admit(lambda: runner.put("a"))
        assert a.result(WAIT_S) == "A"
        b, c = loop.admit(lambda: (runner.put("b"), runner.put("c")))
        assert (b.result(WAIT_S), c.result(WAIT_S)) == ("B", "C")
    finally:
        loop.stop()
    assert seen == [1, 2] and loop.steps == 2 and loop.largest_batch == 2
    assert runner.events == ["step a", "step b,c", "fail_all DeviceStopped 0", "close"]


def test_calls_run_on_the_device_thread_between_steps():
    hold = threading.Event()
    runner = Jobs(hold=hold)
    loop = DeviceLoop("t", runner)
    loop.start()
    try:
        first = loop.admit(lambda: runner.put("a"))
        assert runner.in_step.wait(WAIT_S)
        # Queued while a step runs: the call runs after it, before the next step.
        second = loop.admit(lambda: runner.put("b"))
        call = loop.call(lambda: runner.events.append(f"call on {threading.current_thread().name}"))
        hold.set()
        assert first.result(WAIT_S) == "A" and second.result(WAIT_S) == "B"
        call.result(WAIT_S)
    finally:
        loop.stop()
    assert runner.events[:3] == ["step a", "call on t-loop", "step b"]


def test_a_step_that_raises_fails_every_job_and_call_and_tells_health_once():
    hold = threading.Event()
    runner = Jobs(step_error=ValueError("bad kernel"), hold=hold)
    loop = DeviceLoop("imagegen", runner)
    heard: list[DeviceFailed] = []
    loop.on_failure.append(heard.append)
    loop.start()
    job = loop.admit(lambda: runner.put("a"))
    assert runner.in_step.wait(WAIT_S)
    call = loop.call(lambda: "never")
    hold.set()
    with pytest.raises(DeviceFailed, match="imagegen: the device thread failed: ValueError: bad kernel"):
        job.result(WAIT_S)
    with pytest.raises(DeviceFailed, match="bad kernel"):
        call.result(WAIT_S)
    loop.stop()
    assert len(heard) == 1 and isinstance(heard[0].cause, ValueError)
    # Refused from now on, with the same failure.
    with pytest.raises(DeviceFailed, match="bad kernel"):
        loop.admit(lambda: runner.put("b"))
    with pytest.raises(DeviceFailed, match="bad kernel"):
        loop.call(lambda: None).result(WAIT_S)
    assert runner.events == ["fail_all DeviceFailed 1", "fail_all DeviceFailed 0", "close"]


def test_fail_from_another_thread_ends_jobs_while_the_step_is_blocked():
    hold = threading.Event()
    runner = Jobs(hold=hold)
    loop = DeviceLoop("engine", runner, describe_failure=str)
    loop.start()
    blocked = loop.admit(lambda: runner.put("a"))
    assert runner.in_step.wait(WAIT_S)
    waiting = loop.admit(lambda: runner.put("b"))  # queued behind the blocked step
    assert loop.fail(DeviceFailed("rank 2 died while serving"))
    assert not loop.fail(RuntimeError("second"))  # the first failure stands
    for fut in (blocked, waiting):  # answered now, not when the step returns
        with pytest.raises(DeviceFailed, match="^rank 2 died while serving$"):
            fut.result(WAIT_S)
    hold.set()  # the blocked step returns: nothing is left to answer, nothing more is stepped
    loop.stop()
    assert runner.events == ["fail_all DeviceFailed 2", "step ", "fail_all DeviceFailed 0", "close"]


def test_stop_ends_queued_work_with_device_stopped_after_the_step_in_progress():
    hold = threading.Event()
    runner = Jobs(hold=hold)
    loop = DeviceLoop("talker", runner)
    loop.start()
    running = loop.admit(lambda: runner.put("a"))
    assert runner.in_step.wait(WAIT_S)
    queued = loop.admit(lambda: runner.put("b"))
    call = loop.call(lambda: "never")
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    hold.set()
    stopper.join(WAIT_S)
    assert running.result(WAIT_S) == "A"  # the step in progress finished
    for fut in (queued, call):
        with pytest.raises(DeviceStopped, match="talker: stopped"):
            fut.result(WAIT_S)
    with pytest.raises(DeviceStopped):
        loop.admit(lambda: runner.put("c"))
    assert runner.events == ["step a", "fail_all DeviceStopped 1", "close"]


def test_stop_before_start_ends_what_was_admitted():
    runner = Jobs()
    loop = DeviceLoop("encoder", runner)
    job = loop.admit(lambda: runner.put("a"))
    loop.stop()
    with pytest.raises(DeviceStopped):
        job.result(WAIT_S)
    assert runner.events == ["fail_all DeviceStopped 1", "close"]


def test_an_idle_loop_calls_the_runners_idle_hook():
    runner = Jobs()
    loop = DeviceLoop("engine", runner, idle_wait_s=0.01)
    loop.start()
    try:
        assert runner.idled.wait(WAIT_S)
    finally:
        loop.stop()
    assert runner.events == ["fail_all DeviceStopped 0", "close"]


def test_a_call_queued_while_calls_run_runs_before_the_next_step():
    runner = Jobs()
    loop = DeviceLoop("engine", runner)
    in_call, release = threading.Event(), threading.Event()

    def slow_call() -> None:
        in_call.set()
        assert release.wait(WAIT_S)
        runner.events.append("call 1")

    loop.start()
    try:
        first = loop.call(slow_call)
        assert in_call.wait(WAIT_S)
        job = loop.admit(lambda: runner.put("a"))
        second = loop.call(lambda: runner.events.append("call 2"))
        release.set()
        first.result(WAIT_S), second.result(WAIT_S), job.result(WAIT_S)
    finally:
        loop.stop()
    assert runner.events[:3] == ["call 1", "call 2", "step a"]
