"""TalkerEngine: the talker's request flow — what the servicer and each Speak session call."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

from omnistage.common.runtime.device_loop import DeviceFailed, DeviceLoop
from omnistage.services.talker.runner import (
    JobAudio,
    JobDone,
    JobEvent,
    JobFailed,
    SegmentJob,
    SegmentRunner,
    TalkerRunner,
)

__all__ = ["JobAudio", "JobDone", "JobEvent", "JobFailed", "SegmentJob", "TalkerEngine"]
T = TypeVar("T")


class TalkerEngine:
    """`submit(job)` / `cancel(job)` / `call(fn)` from any thread; `start()` / `stop()` the device loop."""

    def __init__(
        self,
        model: TalkerRunner,
        *,
        service: str = "talker",
        idle_wait_s: float = 0.5,
        on_step: Callable[[int, float], None] | None = None,
        on_admit: Callable[[float], None] | None = None,
        on_failure: Callable[[DeviceFailed], None] | None = None,
    ) -> None:
        self.service = service
        self.runner = SegmentRunner(model)
        self.runner.on_admit = on_admit
        self.loop = DeviceLoop(service, self.runner, idle_wait_s=idle_wait_s)
        if on_step is not None:  # (segments in the step, seconds) after every step: metrics
            self.loop.on_step.append(on_step)
        if on_failure is not None:
            self.loop.on_failure.append(on_failure)

    @property
    def on_admit(self) -> Callable[[float], None] | None:
        """(seconds a job waited for its first step) once per job: metrics."""
        return self.runner.on_admit

    @on_admit.setter
    def on_admit(self, hook: Callable[[float], None] | None) -> None:
        self.runner.on_admit = hook

    def start(self) -> None:
        self.loop.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the step in progress, fail what is left, join the device thread."""
        self.loop.stop(timeout_s)

    @property
    def jobs_in_flight(self) -> int:
        return self.runner.jobs_in_flight

    @property
    def jobs_queued(self) -> int:
        return self.runner.jobs_queued

    def submit(self, job: SegmentJob) -> None:
        """Queue `job` for the next step; raises DeviceStopped / DeviceFailed once the loop has ended."""
        self.loop.admit(lambda: self.runner.put(job))

    def cancel(self, job: SegmentJob) -> None:
        """Drop `job` at the next step boundary (its state and slot are freed there; no more events)."""
        job.cancelled = True
        self.loop.wake()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the device thread between two steps; its result (or exception) in the future."""
        return self.loop.call(fn)

    def step(self) -> None:
        """One step on the calling thread (tests and benches drive the engine by hand, unstarted)."""
        self.loop.step()
