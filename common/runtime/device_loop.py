"""DeviceLoop: the one thread that drives a stage's device; each stage supplies only its step."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from omnistage.common.log import get_logger
from omnistage.common.runtime.blocking import with_this_threads_device

log = get_logger(__name__)
T = TypeVar("T")


class DeviceStopped(RuntimeError):
    """The device loop stopped before this work ran (the service is stopping)."""


class DeviceFailed(RuntimeError):
    """The device loop can serve no more: its step raised, or a failure was reported from elsewhere
    (a TP peer died). `cause` is the error behind it, when there is one."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class DeviceRunner(ABC):
    """What a stage supplies: its batching policy and its step. Only the device thread calls
    `open`, `step`, `idle` and `close`; `has_work` is called on it under the loop's lock."""

    @abstractmethod
    def has_work(self) -> bool:
        """Something to step (a job queued or in flight)."""

    @abstractmethod
    def step(self) -> int:
        """One device step over the jobs the policy picks; returns how many it stepped (0: none).
        An error of one request's work is the runner's to hand to that request; what escapes fails
        the loop."""

    @abstractmethod
    def fail_all(self, error: BaseException) -> None:
        """End every job held (queued or in flight) with `error`. Any thread; idempotent."""

    def wake_in(self) -> float | None:
        """Seconds until work becomes due by itself (a paced job), when `has_work` is False; None: only
        new work makes it due. Called on the device thread under the loop's lock."""
        return None

    def open(self) -> None:  # noqa: B027 - an optional hook: a no-op unless the stage needs it
        """First thing on the device thread (e.g. bind the CUDA device)."""

    def idle(self) -> None:  # noqa: B027 - an optional hook: a no-op unless the stage needs it
        """A turn with nothing to step: at least every `idle_wait_s` while idle."""

    def close(self) -> None:  # noqa: B027 - an optional hook: a no-op unless the stage needs it
        """Last thing on the device thread, after every job has been ended."""


StepHook = Callable[[int, float], None]  # (jobs stepped, seconds the step took)
FailureHook = Callable[[DeviceFailed], None]


def call_in_loop(loop: Any, fn: Callable[..., None], *args: Any) -> None:
    """Hand `fn(*args)` to an asyncio loop from the device thread, never waiting on it; a closed
    loop means nobody is listening any more."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


class DeviceLoop:
    """`start()`, `admit(put)` / `call(fn)` from any thread, `stop()` or `fail(exc)`."""

    def __init__(
        self,
        name: str,
        runner: DeviceRunner,
        *,
        idle_wait_s: float = 0.5,
        describe_failure: Callable[[BaseException], str] | None = None,
        quiet_failures: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.name = name
        self.runner = runner
        self.idle_wait_s = idle_wait_s
        # How a step's error reads in DeviceFailed; default names the loop and the error's type.
        self._describe = describe_failure or (
            lambda exc: f"{name}: the device thread failed: {type(exc).__name__}: {exc}"
        )
        self._quiet = quiet_failures  # errors whose message says it all: logged without a traceback
        self.on_step: list[StepHook] = []
        self.on_failure: list[FailureHook] = []
        self.failure: DeviceFailed | None = None
        self.steps = 0
        self.largest_batch = 0
        self._cv = threading.Condition()
        self._stopped = False
        self._closed = False
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        # The device thread computes on the device current where the loop is made (the stage's).
        self._thread = threading.Thread(
            target=with_this_threads_device(self._run), name=f"{name}-loop", daemon=True
        )

    # -- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """No more work is taken (stopped or failed)."""
        return self._stopped

    def admit(self, put: Callable[[], T]) -> T:
        """Run `put()` (it queues work in the runner) unless the loop no longer takes work, then wake
        the device thread. Raises the loop's failure, or DeviceStopped."""
        with self._cv:
            self._check_open()
            result = put()
            self._cv.notify()
            return result

    def wake(self) -> None:
        """The runner's state changed outside `admit` (a job was cancelled): look again now."""
        with self._cv:
            self._cv.notify()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn()` on the device thread between two steps; the future holds its result, or the
        loop's failure / DeviceStopped when it will never run."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopped:
                fut.set_exception(self._refusal())
                return fut
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    def stop(self, timeout_s: float = 30.0) -> None:
        """Let the step in progress finish, end everything held with DeviceStopped, join the thread.
        After a failure the thread may be blocked for good (in a collective): it is not waited for."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if not self._thread.is_alive():
            if self._thread.ident is None:  # never started: nobody else will end what it holds
                self._close()
            return
        self._thread.join(1.0 if self.failure is not None else timeout_s)
        if self._thread.is_alive() and self.failure is None:
            log.error("%s: the device loop did not stop within %.0fs", self.name, timeout_s)

    def fail(self, exc: BaseException) -> bool:
        """End every job and call with DeviceFailed now and refuse new work, even while the device
        thread is blocked; tell the `on_failure` hooks. False if the loop had failed already."""
        error = exc if isinstance(exc, DeviceFailed) else DeviceFailed(self._describe(exc), exc)
        with self._cv:
            if self.failure is not None:
                return False
            self.failure = error
            self._stopped = True
            calls = self._take_calls()
            self._cv.notify_all()
        self.runner.fail_all(error)
        _fail_calls(calls, error)
        for hook in self.on_failure:
            hook(error)
        return True

    # -- device thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.runner.open()
            while self._await_turn():
                self._run_calls()
                if self._has_work():
                    self.step()
                else:
                    self.runner.idle()
        except BaseException as exc:  # noqa: BLE001 - every job held must hear about it
            if isinstance(exc, self._quiet) or self.failure is not None:
                log.error("%s: the device loop stops: %s", self.name, exc)
            else:
                log.exception("%s: the device loop failed", self.name)
            self.fail(exc)
        finally:
            self._close()

    def _await_turn(self) -> bool:
        """Wait (at most `idle_wait_s`, woken by work or a stop) for a turn; False once stopped."""
        with self._cv:
            if not (self._stopped or self._calls or self.runner.has_work()):
                due = self.runner.wake_in()
                self._cv.wait(self.idle_wait_s if due is None else min(due, self.idle_wait_s))
            return not self._stopped

    def _has_work(self) -> bool:
        with self._cv:
            return self.runner.has_work()

    def _run_calls(self) -> None:
        """Every queued call, also those queued while the others ran, before the next step (an
        abort sent while its request's add ran takes effect before that request is stepped)."""
        while True:
            with self._cv:
                calls = self._take_calls()
            if not calls:
                return
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(exc)

    def step(self) -> None:
        """One step of the runner, counted and reported to the `on_step` hooks: the device thread's
        turn, or a test or bench driving an unstarted loop by hand."""
        started = time.monotonic()
        stepped = self.runner.step()
        if stepped:
            self.steps += 1
            self.largest_batch = max(self.largest_batch, stepped)
            seconds = time.monotonic() - started
            for hook in self.on_step:
                hook(stepped, seconds)

    def _close(self) -> None:
        """End whatever is still held (with the failure, or DeviceStopped), then the runner's close."""
        with self._cv:
            if self._closed:
                return
            self._closed = self._stopped = True
            calls = self._take_calls()
        error = self._refusal()
        self.runner.fail_all(error)
        _fail_calls(calls, error)
        try:
            self.runner.close()
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.exception("%s: closing the runner failed", self.name)

    # -- helpers (the caller holds the lock) -----------------------------------------------------

    def _check_open(self) -> None:
        if self._stopped:
            raise self._refusal()

    def _refusal(self) -> RuntimeError:
        if self.failure is not None:
            return DeviceFailed(str(self.failure), self.failure.cause)
        return DeviceStopped(f"{self.name}: stopped")

    def _take_calls(self) -> list[tuple[Callable[[], Any], concurrent.futures.Future]]:
        calls = list(self._calls)
        self._calls.clear()
        return calls


def _fail_calls(
    calls: list[tuple[Callable[[], Any], concurrent.futures.Future]], error: BaseException
) -> None:
    for _, fut in calls:
        if fut.set_running_or_notify_cancel():
            fut.set_exception(error)
