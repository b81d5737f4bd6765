"""`ServiceRuntime`: the grpc.aio server every service runs on.

It binds the port before anything slow happens (health NOT_SERVING, phase readable through
Describe), serves grpc.health.v1, reflection and omnistage.v1.Control next to the stage API, tracks
in-flight stage RPCs, maps exceptions to status codes, and stops gracefully on SIGTERM/SIGINT:
stop accepting, let in-flight RPCs finish within `drain_grace_s`, cancel the rest, stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import inspect
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from omnistage.common import metrics
from omnistage.common.config import DeployConfig, ServiceConfig, config_hash
from omnistage.common.log import log_fields
from omnistage.common.runtime.errors import abort_with, status_for
from omnistage.common.runtime.phases import PHASES, PhaseReporter, ProgressSnapshot
from omnistage.common.runtime.status_file import status_path
from omnistage.v1 import control_pb2, control_pb2_grpc

_log = logging.getLogger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
CONTROL_SERVICE = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name
# Cancelled RPCs wait this long for their handlers to unwind after the drain deadline.
_CANCEL_WAIT_S = 2.0

MemoryProvider = Callable[[], Sequence[control_pb2.MemoryReport]]
LimitsProvider = Callable[[], control_pb2.Limits]
LoadProvider = Callable[[], tuple[int, int]]


def omnistage_version() -> str:
    try:
        return importlib.metadata.version("omnistage")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def stage_kind_to_proto(kind: str) -> int:
    return control_pb2.StageKind.Value(f"STAGE_KIND_{kind.upper()}")


@dataclass(eq=False)
class InFlight:
    """One running stage RPC (or tracked piece of work)."""

    method: str
    task: asyncio.Task | None
    started: float
    aborted: bool = False


class _HandlerCollector:
    """Stands in for a grpc server so generated `add_*Servicer_to_server` functions hand us their handlers."""

    def __init__(self) -> None:
        self.methods: dict[str, grpc.RpcMethodHandler] = {}
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in handlers.items():
            self.methods[f"/{service}/{name}"] = handler


class _Dispatcher(grpc.GenericRpcHandler):
    """Registered before the server starts, so services can be added after the port is bound."""

    def __init__(self) -> None:
        self.methods: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self.methods.get(handler_call_details.method)


class _ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, runtime: ServiceRuntime) -> None:
        self._rt = runtime

    async def Describe(self, request: control_pb2.DescribeRequest, context: Any) -> control_pb2.DescribeResponse:
        return self._rt.describe()

    async def Drain(self, request: control_pb2.DrainRequest, context: Any) -> control_pb2.DrainResponse:
        grace = request.deadline_ms / 1000 if request.deadline_ms else None
        completed, aborted = await self._rt.drain(grace)
        return control_pb2.DrainResponse(completed=completed, aborted=aborted)


class ServiceRuntime:
    """Server, phase and lifecycle of one service process (rank 0 serves gRPC; other TP ranks do not)."""

    def __init__(
        self,
        cfg: DeployConfig,
        svc: ServiceConfig,
        rank: int = 0,
        *,
        run_dir: str | Path | None = None,
        port: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.svc = svc
        self.rank = rank
        self.name = svc.name
        self.serves_grpc = rank == 0
        self.host = cfg.host
        self.port = svc.port if port is None else port
        self._metrics_port = (svc.metrics_port if rank == 0 else 0) if metrics_port is None else metrics_port
        self.metrics_server: metrics.MetricsServer | None = None
        status = status_path(run_dir, svc.name, rank) if run_dir is not None else None
        self.reporter = PhaseReporter(svc.name, rank, fault=svc.fault, status_file=status)
        self.config_hash = config_hash(svc)
        self.failure = ""
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._dispatcher = _Dispatcher()
        self._stage_services: list[str] = []
        self._calls: set[InFlight] = set()
        self._draining = False
        self._drain_completed = 0
        self._memory_provider: MemoryProvider | None = None
        self._limits_provider: LimitsProvider | None = None
        self._load_provider: LoadProvider | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._signals = 0
        self._shutdown_hooks: list[Callable[[], Any]] = []

    # -- start -------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def phase(self) -> str:
        return self.reporter.phase

    async def start(self) -> None:
        """Bind and start the gRPC server (rank 0) and /metrics; health is NOT_SERVING until `set_serving`."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.reporter.add_listener(self._on_phase)
        if self._metrics_port:
            try:
                self.metrics_server = metrics.start_metrics_server(self._metrics_port, self.host)
            except OSError as exc:
                raise OSError(f"{self.name}: cannot bind metrics port {self.host}:{self._metrics_port}: {exc}") from exc
        if not self.serves_grpc:
            return
        limit = self.svc.max_message_bytes
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
                ("grpc.so_reuseport", 0),  # a second server on our port must fail, not share it
            ]
        )
        self._health = health.aio.HealthServicer()
        self._register(health_pb2_grpc.add_HealthServicer_to_server, self._health)
        self._register(control_pb2_grpc.add_ControlServicer_to_server, _ControlServicer(self))
        self._refresh_reflection()
        server.add_generic_rpc_handlers((self._dispatcher,))
        try:
            bound = server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError as exc:
            raise OSError(f"{self.name}: cannot bind gRPC port {self.address} (in use?): {exc}") from exc
        if bound == 0:
            raise OSError(f"{self.name}: cannot bind gRPC port {self.address} (in use?)")
        self.port = bound
        await server.start()
        self._server = server
        self.reporter.set_address(self.address)
        await self._sync_health()
        log_fields(_log, logging.INFO, "listening", address=self.address, metrics_port=self._metrics_port or "off")

    def add_servicer(self, add_fn: Callable[[Any, Any], None], servicer: Any, full_service_name: str) -> None:
        """Serve a stage API: `add_fn` is the generated `add_<X>Servicer_to_server`.

        Its RPCs are refused with UNAVAILABLE while draining, tracked in flight, timed in metrics,
        and exceptions are mapped through the error table.
        """
        collector = _HandlerCollector()
        add_fn(servicer, collector)
        methods = {m: h for m, h in collector.methods.items() if m.startswith(f"/{full_service_name}/")}
        if not methods:
            raise ValueError(f"{full_service_name}: add function registered no methods of that service")
        for path, handler in methods.items():
            self._dispatcher.methods[path] = self._wrap(path, handler)
        if full_service_name not in self._stage_services:
            self._stage_services.append(full_service_name)
        self._refresh_reflection()
        if self._loop is not None:
            self._schedule(self._sync_health())

    def set_memory_provider(self, fn: MemoryProvider) -> None:
        self._memory_provider = fn

    def set_limits_provider(self, fn: LimitsProvider) -> None:
        self._limits_provider = fn

    def set_load_provider(self, fn: LoadProvider) -> None:
        """`fn() -> (running, queued)` for Describe; default: stage RPCs in flight, 0 queued."""
        self._load_provider = fn

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
        if self._signals > 1:
            log_fields(_log, logging.WARNING, "second signal, exiting now", signal=signal.Signals(sig).name)
            os._exit(1)
        log_fields(_log, logging.INFO, "stopping", signal=signal.Signals(sig).name)
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
        """Drain (bounded by drain_grace_s), run the shutdown hooks, stop the server and /metrics."""
        if not self.failure:
            await self.drain()
        await self._run_shutdown_hooks()
        self.reporter.enter("stopped")
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    async def drain(self, grace_s: float | None = None) -> tuple[int, int]:
        """Refuse new stage RPCs, wait up to `grace_s` for in-flight ones, cancel the rest.

        Returns (completed during the drain, aborted).
        """
        assert self._idle is not None, "start() first"
        grace = self.svc.drain_grace_s if grace_s is None else grace_s
        if not self._draining:
            self._draining = True
            self._drain_completed = 0
            self.reporter.enter("draining")
            if self._health is not None:
                await self._health.enter_graceful_shutdown()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace)
        except TimeoutError:
            pass
        pending = [c for c in self._calls if not c.aborted]
        for call in pending:
            call.aborted = True
            if call.task is not None:
                call.task.cancel()
        if pending:
            log_fields(_log, logging.WARNING, "drain deadline passed, cancelling", requests=len(pending), grace_s=grace)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=_CANCEL_WAIT_S)
        return self._drain_completed, len(pending)

    # -- in-flight tracking ------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    @contextlib.asynccontextmanager
    async def track(self, method: str) -> AsyncIterator[InFlight]:
        """Mark work as in flight (Drain waits for it, Describe counts it); stage RPCs are tracked already."""
        assert self._idle is not None, "start() first"
        call = InFlight(method, asyncio.current_task(), time.monotonic())
        self._calls.add(call)
        self._idle.clear()
        metrics.rpc_in_flight().labels(self.name).inc()
        try:
            yield call
        finally:
            self._calls.discard(call)
            metrics.rpc_in_flight().labels(self.name).dec()
            if self._draining and not call.aborted:
                self._drain_completed += 1
            if not self._calls:
                self._idle.set()

    def _wrap(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        field = next(f for f in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, f))
        behavior = getattr(handler, field)
        wrapped = self._wrap_stream(path, behavior) if inspect.isasyncgenfunction(behavior) else (
            self._wrap_unary(path, behavior))
        return handler._replace(**{field: wrapped})

    def _wrap_unary(self, path: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._refuse_if_draining(context)
            started, code = time.monotonic(), grpc.StatusCode.OK
            async with self.track(path) as token:
                try:
                    return await behavior(request, context)
                except BaseException as exc:
                    code = await self._handle(exc, token, context)
                    raise
                finally:
                    self._observe(path, code, started)

        return call

    def _wrap_stream(self, path: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._refuse_if_draining(context)
            started, code = time.monotonic(), grpc.StatusCode.OK
            async with self.track(path) as token:
                try:
                    async for item in behavior(request, context):
                        yield item
                except BaseException as exc:
                    code = await self._handle(exc, token, context)
                    raise
                finally:
                    self._observe(path, code, started)

        return call

    async def _refuse_if_draining(self, context: grpc.aio.ServicerContext) -> None:
        if self._draining:
            metrics.rpc_requests().labels(self.name, "refused", grpc.StatusCode.UNAVAILABLE.name).inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is draining")

    async def _handle(self, exc: BaseException, token: InFlight, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
        """Turn a handler exception into a status (raises AbortError), or pass it on; returns the code."""
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            if token.aborted and isinstance(exc, asyncio.CancelledError):  # our drain deadline, not the client: tell the client why
                await context.abort(grpc.StatusCode.CANCELLED, f"{self.name}: aborted, drain deadline passed")
            return grpc.StatusCode.CANCELLED
        if isinstance(exc, grpc.aio.AbortError):
            return context.code() or grpc.StatusCode.UNKNOWN
        if isinstance(exc, Exception):
            code = status_for(exc)[0]
            await abort_with(context, exc)
            return code
        return grpc.StatusCode.UNKNOWN

    def _observe(self, path: str, code: grpc.StatusCode, started: float) -> None:
        method = path.rsplit("/", 1)[-1]
        metrics.rpc_requests().labels(self.name, method, code.name).inc()
        metrics.rpc_latency().labels(self.name, method).observe(time.monotonic() - started)

    # -- Describe ----------------------------------------------------------------------------

    def describe(self) -> control_pb2.DescribeResponse:
        running, queued = len(self._calls), 0
        if self._load_provider is not None:
            running, queued = _guarded("load provider", self._load_provider, (running, queued))
        limits = control_pb2.Limits(max_message_bytes=self.svc.max_message_bytes)
        if self._limits_provider is not None:
            limits = _guarded("limits provider", self._limits_provider, limits)
        memory = _guarded("memory provider", self._memory_provider, []) if self._memory_provider else []
        return control_pb2.DescribeResponse(
            name=self.name,
            kind=stage_kind_to_proto(self.svc.kind),
            version=omnistage_version(),
            model="" if self.svc.kind == "gateway" else self.cfg.model.checkpoint,
            rank=self.rank,
            world_size=self.svc.tp_size,
            progress=self.reporter.to_proto(),
            memory=list(memory),
            limits=limits,
            config_hash=self.config_hash,
            running_requests=running,
            queued_requests=queued,
            failure=self.failure or self.reporter.snapshot().failure,
            pid=os.getpid(),
        )

    # -- internals ---------------------------------------------------------------------------

    def _register(self, add_fn: Callable[[Any, Any], None], servicer: Any) -> None:
        collector = _HandlerCollector()
        add_fn(servicer, collector)
        self._dispatcher.methods.update(collector.methods)

    def _refresh_reflection(self) -> None:
        names = [HEALTH_SERVICE, CONTROL_SERVICE, REFLECTION_SERVICE, *self._stage_services]
        self._register(reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection.aio.ReflectionServicer(names))

    def _on_phase(self, snap: ProgressSnapshot) -> None:
        metrics.set_phase(self.name, self.rank, snap.phase, PHASES, snap.done)
        if self._health is not None and self._loop is not None:
            self._schedule(self._sync_health())

    def _schedule(self, coro: Any) -> None:
        assert self._loop is not None
        if _in_loop(self._loop):
            self._loop.create_task(coro)
        else:
            self._loop.call_soon_threadsafe(self._loop.create_task, coro)

    async def _sync_health(self) -> None:
        """Health follows the phase: SERVING only in `serving` (read now, so late tasks cannot regress it)."""
        if self._health is None:
            return
        ok = self.reporter.phase == "serving" and not self._draining
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self._stage_services):
            await self._health.set(name, status)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _guarded(what: str, fn: Callable[[], Any], default: Any) -> Any:
    """A failing provider must not break Describe: log and answer with the default."""
    try:
        return fn()
    except Exception:
        _log.exception("%s failed", what)
        return default

