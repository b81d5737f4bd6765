"""`ServiceRuntime`: the lifecycle of one service process — phase, servers (`ports.py`), drain, stop."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omnistage.common import metrics
from omnistage.common.config import DeployConfig, ServiceConfig, config_hash, join_host_port
from omnistage.common.log import log_fields
from omnistage.common.runtime.calls import CallGuard, InFlight
from omnistage.common.runtime.control import (
    DRAIN_BY_CONTROL,
    ControlServicer,
    LimitsProvider,
    LoadProvider,
    MemoryProvider,
    ReadinessProvider,
)
from omnistage.common.runtime.drain import Drain
from omnistage.common.runtime.errors import FailedPrecondition
from omnistage.common.runtime.memory_trim import MemoryTrimmer
from omnistage.common.runtime.phases import PHASES, PhaseReporter, ProgressSnapshot
from omnistage.common.runtime.ports import CONTROL_SERVICE, HEALTH_SERVICE, PUBLIC_API, ServicePorts
from omnistage.common.runtime.status_file import status_path
from omnistage.common.runtime.wire_bounds import WireBounds
from omnistage.v1 import control_pb2

_log = logging.getLogger(__name__)

__all__ = ["CONTROL_SERVICE", "HEALTH_SERVICE", "PUBLIC_API", "InFlight", "ServiceRuntime"]


class ServiceRuntime:
    """Servers, phase and lifecycle of one service process (rank 0 serves gRPC; other TP ranks do not)."""

    def __init__(
        self,
        cfg: DeployConfig,
        svc: ServiceConfig,
        rank: int = 0,
        *,
        run_dir: str | Path | None = None,
        port: int | None = None,
        admin_port: int | None = None,
        metrics_port: int | None = None,
        max_receive_bytes: int | None = None,
    ) -> None:
        self.cfg = cfg
        # The main port's receive limit: max_message_bytes, or less where the service knows that no
        # legitimate request is larger (the gateway's public API).
        self.max_receive_bytes = min(svc.max_message_bytes, max_receive_bytes or svc.max_message_bytes)
        self.svc = svc
        self.rank = rank
        self.name = svc.name
        metrics.set_process_service(svc.name)  # the `service` label of shared code (the tensor transport)
        self.serves_grpc = rank == 0
        self.port = svc.port if port is None else port
        self.admin_port = svc.admin_port if admin_port is None else admin_port
        self._metrics_port = (svc.metrics_port if rank == 0 else 0) if metrics_port is None else metrics_port
        self.metrics_server: metrics.MetricsServer | None = None
        status = status_path(run_dir, svc.name, rank) if run_dir is not None else None
        self.reporter = PhaseReporter(svc.name, rank, fault=svc.fault, status_file=status)
        self.config_hash = config_hash(svc)
        self.failure = ""
        self.memory_provider: MemoryProvider | None = None
        self.limits_provider: LimitsProvider | None = None
        self.load_provider: LoadProvider | None = None
        self.readiness_provider: ReadinessProvider | None = None
        self.trimmer = MemoryTrimmer(min_interval_s=svc.memory_trim_interval_s)
        self.calls = CallGuard(svc.name, self.trimmer)
        self.calls.refusal = lambda: f"{self.name} is draining" if self._drain.active else ""
        self.ports = ServicePorts(svc, self.calls, admin=bool(self.admin_port and self.serves_grpc))
        self._drain = Drain(svc.name, self.calls, self.reporter, self._sync_health)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_cause = "stop requested"
        self._signals = 0
        self._shutdown_hooks: list[Callable[[], Any]] = []
        self._beat_task: asyncio.Task | None = None

    # -- start -------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """HOST:PORT of the main port as clients dial it."""
        return join_host_port(self.cfg.dial_host(self.svc.bind_host), self.port)

    @property
    def admin_address(self) -> str:
        """HOST:PORT of the admin port as clients dial it; '' when there is none."""
        if self.ports.admin is None:
            return ""
        return join_host_port(self.cfg.dial_host(self.svc.admin_host), self.admin_port)

    @property
    def phase(self) -> str:
        return self.reporter.phase

    @property
    def in_flight(self) -> int:
        return len(self.calls.calls)

    async def start(self) -> None:
        """Bind the main and admin ports (rank 0) and /metrics; health is NOT_SERVING until `set_serving`.

        Raises OSError naming the config key of a port that cannot be bound, and auth.SecretError
        for a key or certificate that cannot be read.
        """
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.reporter.add_listener(self._on_phase)
        self._beat_task = self._loop.create_task(self._beat(self.cfg.supervision.heartbeat_interval_s))
        if self._metrics_port:
            try:
                self.metrics_server = metrics.start_metrics_server(self._metrics_port, self.cfg.host)
            except OSError as exc:
                raise OSError(
                    f"services.{self.name}.metrics_port: cannot bind "
                    f"{join_host_port(self.cfg.host, self._metrics_port)}: {exc}"
                ) from exc
        if not self.serves_grpc:
            return
        self.ports.register(ControlServicer(self))
        await self._sync_health()  # NOT_SERVING before the first client can ask
        self.port, self.admin_port = await self.ports.bind(self.port, self.admin_port, self.max_receive_bytes)
        self.reporter.set_address(self.address)
        log_fields(
            _log,
            logging.INFO,
            "listening",
            address=self.address,
            admin=self.admin_address or "off",
            tls="on" if self.ports.tls else "off",
            api_keys="on" if self.ports.api_keys else "off",
            metrics_port=self._metrics_port or "off",
        )

    def add_servicer(
        self,
        add_fn: Callable[[Any, Any], None],
        servicer: Any,
        full_service_name: str,
        bounds: Mapping[str, WireBounds] | None = None,
    ) -> None:
        """Serve a stage API on the main port: `add_fn` is the generated `add_<X>Servicer_to_server`.

        Its RPCs need the API key when one is configured, are refused with UNAVAILABLE while
        draining, tracked in flight, counted in metrics, and exceptions go through the error table.
        `bounds`: method name → the wire bounds of its request (default: the record budget).
        """
        self.ports.add_stage(add_fn, servicer, full_service_name, bounds)
        if self._loop is not None:
            self._schedule(self._sync_health())

    def set_memory_provider(self, fn: MemoryProvider) -> None:
        self.memory_provider = fn

    def set_limits_provider(self, fn: LimitsProvider) -> None:
        self.limits_provider = fn

    def set_load_provider(self, fn: LoadProvider) -> None:
        """`fn() -> (running, queued)` for Describe; default: stage RPCs in flight, 0 queued."""
        self.load_provider = fn

    def set_readiness_provider(self, fn: Callable[[], list[control_pb2.Readiness]]) -> None:
        """`fn()` → Describe's readiness (the gateway's capabilities)."""
        self.readiness_provider = fn

    def set_capability_health(self, ready: dict[str, bool]) -> None:
        """Serve `omnistage.v1.Omni.<capability>` health names: SERVING while the service serves and
        the capability is ready (clients and probes can wait for speech or images, not just text)."""
        self.ports.parts = {f"{PUBLIC_API}.{name}": ok for name, ok in ready.items()}
        if self._loop is not None:
            self._schedule(self._sync_health())

    # -- lifecycle ---------------------------------------------------------------------------

    def set_serving(self) -> None:
        """Ready: phase serving, health SERVING (call only after a real warm-up forward)."""
        self.reporter.enter("serving")

    def fail(self, message: str, culprit_rank: int | None = None) -> None:
        """Phase failed, health NOT_SERVING, and `serve_until_stopped` returns 1 (thread-safe).
        `culprit_rank`: the TP rank whose failure this is, when another rank's (default: this one)."""
        if not self.failure:
            self.failure = message
        self.reporter.fail(message, culprit_rank)
        self.request_stop()

    def request_stop(self) -> None:
        """Begin the graceful stop (what SIGTERM does); safe from any thread."""
        if self._loop is None or self._stop is None:
            return
        if _in_loop(self._loop):
            self._stop.set()
        else:
            self._loop.call_soon_threadsafe(self._stop.set)

    @property
    def stop_requested(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    async def wait_stop_requested(self) -> None:
        assert self._stop is not None, "start() first"
        await self._stop.wait()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: graceful stop; a second signal exits at once."""
        assert self._loop is not None, "start() first"
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        name = signal.Signals(sig).name
        if self._signals > 1:
            log_fields(_log, logging.WARNING, "second signal, exiting now", signal=name)
            os._exit(1)
        log_fields(_log, logging.INFO, "stopping", signal=name)
        self._stop_cause = name
        self.request_stop()

    async def serve_until_stopped(self) -> int:
        """Serve until SIGTERM/SIGINT, `request_stop` or `fail`; then drain and stop. 0, or 1 if failed."""
        assert self._stop is not None, "start() first"
        await self._stop.wait()
        await self.shutdown()
        return 1 if self.failure else 0

    def add_shutdown_hook(self, fn: Callable[[], Any]) -> None:
        """Run `fn` (sync, or returning an awaitable) after the drain, before the server stops.

        The thinker stops its engine here: in-flight requests have finished by then.
        """
        self._shutdown_hooks.append(fn)

    async def _run_shutdown_hooks(self) -> None:
        for fn in reversed(self._shutdown_hooks):
            try:
                result = await asyncio.to_thread(fn) if not inspect.iscoroutinefunction(fn) else fn()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - one failing hook must not keep the others from running
                _log.exception("shutdown hook %r failed", fn)
        self._shutdown_hooks.clear()

    async def shutdown(self) -> None:
        """Drain (bounded by drain_grace_s), run the shutdown hooks, stop the servers and /metrics."""
        if not self.failure:
            await self.drain(by=f"stopping: {self._stop_cause}")
        await self._run_shutdown_hooks()
        self.reporter.enter("stopped")
        self.trimmer.cancel()
        self.calls.large.close()
        await self._stop_servers()
        if self._beat_task is not None:
            self._beat_task.cancel()

    async def _beat(self, interval_s: float) -> None:
        """Liveness for the launcher, on the event loop on purpose: a loop that is stuck (or a process
        that is stopped) stops beating, and the launcher restarts the service."""
        while True:
            try:
                self.reporter.beat()  # a small atomic file write: no thread, so it stops with the loop
            except OSError as exc:  # a full disk must not end the service; the launcher will notice
                log_fields(_log, logging.WARNING, "heartbeat write failed", error=str(exc))
            await asyncio.sleep(interval_s)

    async def _stop_servers(self) -> None:
        await self.ports.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    # -- drain and resume --------------------------------------------------------------------

    async def drain(self, grace_s: float | None = None, *, by: str = "") -> tuple[int, int]:
        """Refuse new stage RPCs, wait up to `grace_s` for in-flight ones, cancel the rest.

        `by` says who asked (phase detail, status file, launcher output). A drain by Control can be
        undone by `resume` (the wait then ends early, cancelling nothing); a drain for a stop cannot.
        Returns (completed during the drain, aborted).
        """
        if by == DRAIN_BY_CONTROL and (self.stop_requested or self.phase not in ("serving", "draining")):
            raise FailedPrecondition(
                f"{self.name} is in phase {self.phase}"
                f"{' (stopping)' if self.stop_requested else ''}: only a serving service drains"
            )
        grace = self.svc.drain_grace_s if grace_s is None else grace_s
        return await self._drain.run(grace, by or self._stop_cause)

    def resume(self) -> None:
        """Serve again after a drain by Control (not after a stop: SIGTERM is final)."""
        stopping = self.stop_requested or self.phase in ("stopped", "failed")
        self._drain.resume(self._stop_cause if stopping else "")

    # -- in-flight tracking ------------------------------------------------------------------

    def track(self, method: str) -> contextlib.AbstractAsyncContextManager[InFlight]:
        """Mark work as in flight (Drain waits for it, Describe counts it); stage RPCs are tracked already."""
        return self.calls.track(method)

    # -- internals ---------------------------------------------------------------------------

    def _on_phase(self, snap: ProgressSnapshot) -> None:
        metrics.set_phase(self.name, self.rank, snap.phase, PHASES, snap.done)
        if self._loop is not None:
            self._schedule(self._sync_health())

    def _schedule(self, coro: Any) -> None:
        assert self._loop is not None
        if _in_loop(self._loop):
            self._loop.create_task(coro)
        else:
            self._loop.call_soon_threadsafe(self._loop.create_task, coro)

    async def _sync_health(self) -> None:
        """Health follows the phase: SERVING only in `serving` (read now, so late tasks cannot regress it)."""
        await self.ports.sync_health(self.reporter.phase == "serving" and not self._drain.active)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
