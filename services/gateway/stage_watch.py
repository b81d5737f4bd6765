"""StageWatch: the gateway's view of whether one stage can take calls, from start-up on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2
from omnistage.common.config import GatewayConfig
from omnistage.common.runtime.deadlines import within
from omnistage.services.gateway.stages import StageClient

_log = logging.getLogger(__name__)

OnChange = Callable[[StageClient], None]


class StageWatch:
    """Admits one stage when it is SERVING (after `on_up`), marks it down when it stops answering."""

    def __init__(
        self,
        client: StageClient,
        cfg: GatewayConfig,
        on_up: Callable[[], Awaitable[None]] | None = None,
        on_change: OnChange | None = None,
    ) -> None:
        self.client = client
        self.cfg = cfg  # how often and how patiently: its stage_health_* keys
        self.on_up = on_up
        self.on_change = on_change
        self.admitted = asyncio.Event()  # set while the stage is up
        self.times_admitted = 0
        self.times_lost = 0
        self._task: asyncio.Task | None = None
        self._follow_task: asyncio.Task | None = None
        self._wake = asyncio.Event()  # the stage's Health.Watch said something: check now
        client.down_reason = "starting (not SERVING yet)"
        client.on_unreachable = self._unreachable

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"watch-{self.client.name}")
        self._follow_task = asyncio.create_task(self._follow(), name=f"health-watch-{self.client.name}")

    async def stop(self) -> None:
        for task in (self._task, self._follow_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _follow(self) -> None:
        """Wake the checks whenever the stage's health stream sends a status (its first, and every
        change); the stream waits for the channel to connect, and is opened again when it ends."""
        while True:
            try:
                call = self.client.health.Watch(
                    health_pb2.HealthCheckRequest(service=""), wait_for_ready=True
                )
                async for _ in call:
                    self._wake.set()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # polling alone
            except Exception:  # noqa: BLE001 - the channel was closed (shutdown): polling ends too
                return
            await asyncio.sleep(
                min(self.cfg.stage_health_interval_s, 0.2)
            )  # a stream that ended: the stage went away

    async def wait_admitted(self, timeout_s: float) -> bool:
        """True once the stage is up (False when `timeout_s` passed first)."""
        try:
            await within(self.admitted.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _check(self) -> str:
        """'' when the stage answers SERVING, else what it said."""
        try:
            resp = await self.client.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.cfg.stage_health_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no health answer within {self.cfg.stage_health_timeout_s:g}s"
            return f"health check {exc.code().name}: {exc.details()}"
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return ""
        return f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"

    async def _run(self) -> None:
        misses, since = 0, time.monotonic()
        while True:
            why = await self._check()
            if not why and not self.client.up:
                why = await self._admit()
            if why and self.client.up:
                misses += 1
                if misses >= self.cfg.stage_health_failures:
                    self._lose(f"{why} ({misses} checks in {time.monotonic() - since:.1f}s)")
            elif not why:
                misses, since = 0, time.monotonic()
            with contextlib.suppress(TimeoutError):
                await within(self._wake.wait(), self.cfg.stage_health_interval_s)
            self._wake.clear()

    async def _admit(self) -> str:
        """The stage says SERVING: run its on_up step (limits, warm-up); '' when it is admitted."""
        if self.on_up is not None:
            try:
                await self.on_up()
            except Exception as exc:  # noqa: BLE001 - a failed warm-up keeps the stage out, and says why
                reason = f"warm-up failed: {type(exc).__name__}: {exc}"
                if self.client.down_reason != reason:
                    _log.warning("stage %s is SERVING but not admitted: %s", self.client.name, reason)
                self.client.down_reason = reason
                return ""  # not a health miss: the stage answers; the next round tries again
        again = self.times_admitted > 0
        self.client.down_reason = ""
        self.times_admitted += 1
        self.admitted.set()
        _log.info("stage %s %s", self.client.name, "SERVING again: re-admitted" if again else "admitted")
        self._changed()
        return ""

    def _unreachable(self, why: str) -> None:
        """A call found the stage unreachable: down now, without waiting for `failures` health checks."""
        if self.client.up:
            self._lose(f"a call found it unreachable ({why})")

    def _lose(self, why: str) -> None:
        self.client.down_reason = f"stopped answering: {why}"
        self.admitted.clear()
        self.times_lost += 1
        # The gates shrink first: the slots the lost calls give back are no longer the stage's to hand on.
        self._changed()
        lost = self.client.lose_calls()
        _log.error("stage %s is down (%s); failed %d call(s) in flight on it", self.client.name, why, lost)

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self.client)
            except Exception:  # noqa: BLE001 - a broken listener must not stop the watch
                _log.exception("stage watch listener failed")
