"""ServicePorts: the main and admin gRPC servers of one service — binding, handlers, reflection, health.

The main port serves the stage API (or the gateway's public one) with health and reflection; the
admin port (loopback by default) serves Control with health and reflection. Health follows the
phase: SERVING only while the service serves and is not draining (`sync_health`).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from omnistage.common.config import ServiceConfig, join_host_port
from omnistage.common.log import log_fields
from omnistage.common.runtime import auth, reflection
from omnistage.common.runtime.calls import CallGuard
from omnistage.common.runtime.handlers import Dispatcher, collect
from omnistage.common.runtime.wire_bounds import WireBounds
from omnistage.v1 import control_pb2, control_pb2_grpc

_log = logging.getLogger(__name__)

# The public API's service name: the prefix of the gateway's per-capability health names.
PUBLIC_API = "omnistage.v1.Omni"
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
CONTROL_SERVICE = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
# A generated `add_<X>Servicer_to_server`, and a stage API's wire bounds by method name.
AddFn = Callable[[Any, Any], None]
Bounds = Mapping[str, WireBounds]
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(eq=False)
class Port:
    """One listening server: its dispatcher, health, and the services reflection lists."""

    key: str  # the config key of its port ("services.gateway.port"), for messages
    dispatcher: Dispatcher = field(default_factory=Dispatcher)
    health: health.aio.HealthServicer = field(default_factory=health.aio.HealthServicer)
    services: list[str] = field(default_factory=list)
    server: grpc.aio.Server | None = None
    address: str = ""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ServicePorts:
    """The servers of one service (rank 0): every handler goes through its `CallGuard`."""

    def __init__(self, svc: ServiceConfig, calls: CallGuard, *, admin: bool) -> None:
        self.svc = svc
        self.calls = calls
        self.main = Port(f"services.{svc.name}.port")
        self.admin = Port(f"services.{svc.name}.admin_port") if admin else None
        self.api_keys: auth.ApiKeys | None = None
        self.stage_services: list[str] = []
        # Health names of parts of the service that come and go on their own (the gateway's
        # capabilities): name → ready; SERVING only while the service serves and the part is ready.
        self.parts: dict[str, bool] = {}
        self.tls = False

    def register(self, control: Any) -> None:
        """Health and reflection on both ports, Control on the admin port (its own keys)."""
        svc = self.svc
        self.api_keys = auth.with_stage_key(auth.api_keys(svc), svc)  # a stage: the stage key too
        if svc.kind != "gateway" and not is_loopback(svc.bind_host):
            log_fields(
                _log,
                logging.WARNING,
                "internal service listens beyond this host",
                bind_host=svc.bind_host,
                hint=f"services.{svc.name}.bind_host: only the gateway needs outside clients",
            )
        self._add(self.main, health_pb2_grpc.add_HealthServicer_to_server, self.main.health)
        self._refresh_reflection(self.main)
        if self.admin is not None:
            admin_keys = auth.with_stage_key(auth.admin_keys(svc), svc)
            self.admin.services.append(CONTROL_SERVICE)
            self._add(self.admin, health_pb2_grpc.add_HealthServicer_to_server, self.admin.health)
            self._add(self.admin, control_pb2_grpc.add_ControlServicer_to_server, control, keys=admin_keys)
            self._refresh_reflection(self.admin)

    async def bind(self, port: int, admin_port: int, receive_limit: int) -> tuple[int, int]:
        """Start both servers; returns the bound (port, admin port). A half-started service keeps no port."""
        credentials = auth.server_credentials(self.svc)
        try:
            port = await self._bind(self.main, self.svc.bind_host, port, credentials, receive_limit)
            if self.admin is not None:
                admin_port = await self._bind(self.admin, self.svc.admin_host, admin_port, None)
        except BaseException:
            await self.stop()
            raise
        self.tls = credentials is not None
        return port, admin_port

    def add_stage(self, add_fn: AddFn, servicer: Any, name: str, bounds: Bounds | None = None) -> None:
        """Serve the stage API `name` on the main port (see `ServiceRuntime.add_servicer`)."""
        methods = {m: h for m, h in collect(add_fn, servicer).items() if m.startswith(f"/{name}/")}
        if not methods:
            raise ValueError(f"{name}: add function registered no methods of that service")
        for path, handler in methods.items():
            self.main.dispatcher.methods[path] = self.calls.wrap(
                path,
                handler,
                keys=self.api_keys,
                stage=True,
                bounds=(bounds or {}).get(path.rsplit("/", 1)[-1]),
            )
        if name not in self.stage_services:
            self.stage_services.append(name)
            self.main.services.append(name)
        self._refresh_reflection(self.main)

    async def sync_health(self, serving: bool) -> None:
        """Every health name of both ports, SERVING when `serving` (Control's own name: while its port is up)."""
        status = _SERVING if serving else _NOT_SERVING
        for name in ("", *self.stage_services):
            await self.main.health.set(name, status)
        for name, ready in self.parts.items():
            await self.main.health.set(name, status if ready else _NOT_SERVING)
        if self.admin is not None:
            await self.admin.health.set("", status)
            await self.admin.health.set(CONTROL_SERVICE, _SERVING)

    async def stop(self) -> None:
        for port in (self.main, self.admin):
            if port is not None and port.server is not None:
                await port.health.enter_graceful_shutdown()
                await port.server.stop(grace=0.5)
                port.server = None

    async def _bind(
        self,
        port: Port,
        host: str,
        number: int,
        credentials: grpc.ServerCredentials | None,
        receive_limit: int | None = None,
    ) -> int:
        limit = self.svc.max_message_bytes
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", receive_limit or limit),
                ("grpc.so_reuseport", 0),  # a second server on our port must fail, not share it
                # Clients (the gateway) send keepalive pings every 10 s, also between calls.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ]
        )
        server.add_generic_rpc_handlers((port.dispatcher,))
        where = join_host_port(host, number)
        try:
            bound = (
                server.add_secure_port(where, credentials) if credentials else server.add_insecure_port(where)
            )
        except RuntimeError as exc:
            raise OSError(f"{port.key}: cannot bind {where} (in use?): {exc}") from exc
        if bound == 0:
            raise OSError(f"{port.key}: cannot bind {where} (in use?)")
        await server.start()
        port.server, port.address = server, join_host_port(host, bound)
        return bound

    def _add(self, port: Port, add_fn: AddFn, servicer: Any, keys: auth.ApiKeys | None = None) -> None:
        for path, handler in collect(add_fn, servicer).items():
            port.dispatcher.methods[path] = self.calls.wrap(path, handler, keys=keys, stage=False)

    def _refresh_reflection(self, port: Port) -> None:
        for path, handler in reflection.reflection_handlers([HEALTH_SERVICE, *port.services]).items():
            port.dispatcher.methods[path] = self.calls.wrap(path, handler, keys=None, stage=False)
