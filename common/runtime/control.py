"""`omnistage.v1.Control` of a service (admin port only): Describe, Drain, Resume."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from omnistage.v1 import control_pb2, control_pb2_grpc

if TYPE_CHECKING:
    from omnistage.common.config import DeployConfig, ServiceConfig
    from omnistage.common.runtime.phases import PhaseReporter

_log = logging.getLogger(__name__)

# Who asked for a drain, as the phase detail, the status file and the launcher show it.
DRAIN_BY_CONTROL = "Control.Drain"
RESUME_BY_CONTROL = "Control.Resume"


MemoryProvider = Callable[[], Sequence[control_pb2.MemoryReport]]
LimitsProvider = Callable[[], control_pb2.Limits]
LoadProvider = Callable[[], tuple[int, int]]
ReadinessProvider = Callable[[], list[control_pb2.Readiness]]


class ControlledRuntime(Protocol):
    """What Control reads and calls of the service's runtime (server.ServiceRuntime)."""

    name: str
    rank: int
    cfg: DeployConfig
    svc: ServiceConfig
    reporter: PhaseReporter
    config_hash: str
    failure: str
    memory_provider: MemoryProvider | None
    limits_provider: LimitsProvider | None
    load_provider: LoadProvider | None
    readiness_provider: ReadinessProvider | None

    @property
    def in_flight(self) -> int: ...

    async def drain(self, grace_s: float | None = None, *, by: str = "") -> tuple[int, int]: ...

    def resume(self) -> None: ...


def omnistage_version() -> str:
    try:
        return importlib.metadata.version("omnistage")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def stage_kind_to_proto(kind: str) -> int:
    return control_pb2.StageKind.Value(f"STAGE_KIND_{kind.upper()}")


class ControlServicer(control_pb2_grpc.ControlServicer):
    """One short method per RPC; the runtime holds the state."""

    def __init__(self, runtime: ControlledRuntime) -> None:
        self._rt = runtime

    async def Describe(
        self, request: control_pb2.DescribeRequest, context: Any
    ) -> control_pb2.DescribeResponse:
        return describe(self._rt)

    async def Drain(self, request: control_pb2.DrainRequest, context: Any) -> control_pb2.DrainResponse:
        grace = request.deadline_ms / 1000 if request.deadline_ms else None
        completed, aborted = await self._rt.drain(grace, by=DRAIN_BY_CONTROL)
        return control_pb2.DrainResponse(completed=completed, aborted=aborted)

    async def Resume(self, request: control_pb2.ResumeRequest, context: Any) -> control_pb2.ResumeResponse:
        self._rt.resume()
        return control_pb2.ResumeResponse(phase=control_pb2.PHASE_SERVING)


def describe(rt: ControlledRuntime) -> control_pb2.DescribeResponse:
    """What the service is and how it is doing; a failing provider answers with its default."""
    running, queued = rt.in_flight, 0
    if rt.load_provider is not None:
        running, queued = _guarded("load provider", rt.load_provider, (running, queued))
    limits = control_pb2.Limits(max_message_bytes=rt.svc.max_message_bytes)
    if rt.limits_provider is not None:
        limits = _guarded("limits provider", rt.limits_provider, limits)
    memory = _guarded("memory provider", rt.memory_provider, []) if rt.memory_provider else []
    return control_pb2.DescribeResponse(
        name=rt.name,
        kind=stage_kind_to_proto(rt.svc.kind),
        version=omnistage_version(),
        model="" if rt.svc.kind == "gateway" else rt.cfg.model.checkpoint,
        rank=rt.rank,
        world_size=rt.svc.tp_size,
        progress=rt.reporter.to_proto(),
        memory=list(memory),
        limits=limits,
        config_hash=rt.config_hash,
        running_requests=running,
        queued_requests=queued,
        failure=rt.failure or rt.reporter.snapshot().failure,
        pid=os.getpid(),
        readiness=_guarded("readiness provider", rt.readiness_provider, []) if rt.readiness_provider else [],
    )


def _guarded(what: str, fn: Callable[[], Any], default: Any) -> Any:
    try:
        return fn()
    except Exception:
        _log.exception("%s failed", what)
        return default
