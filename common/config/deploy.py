"""The whole deployment on one host (`DeployConfig`), its model and how its services are dialed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from omnistage.common.config.checks import ConfigError
from omnistage.common.config.devices import DevicesConfig
from omnistage.common.config.service import ServiceConfig
from omnistage.common.config.startup import StartupConfig
from omnistage.common.config.supervision import SupervisionConfig
from omnistage.common.stages import CAPABILITIES


@dataclass(frozen=True)
class ModelConfig:
    """The checkpoint served."""

    # Directory of the HF-layout checkpoint (relative paths are relative to the working directory).
    checkpoint: str = ".cache/tiny-ming"
    # "safetensors": read the weights; "dummy": random weights in the real shapes and dtype, made on
    # the device (benchmarks; the directory needs only config.json and the tokenizer).
    load_format: Literal["safetensors", "dummy"] = "safetensors"


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def join_host_port(host: str, port: int) -> str:
    """`127.0.0.1:7151`, `[::1]:7151`: the form gRPC targets and bind addresses take."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


# Public capabilities and the stage kinds each needs (common/stages.py): the gateway serves each one as
# soon as its stages are admitted (health names `omnistage.v1.Omni.<capability>`, Describe.readiness),
# and the launcher's "ready" waits for all of them.
CAPABILITY_HEALTH_PREFIX = "omnistage.v1.Omni."


@dataclass(frozen=True)
class DeployConfig:
    """A whole deployment on one host."""

    version: int = 1
    # Address of this host: services bound to a wildcard address are dialed here; /metrics and the
    # TP rendezvous bind here.
    host: str = "127.0.0.1"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Log format: "text" for people, "json" for collectors.
    log_format: Literal["text", "json"] = "text"
    model: ModelConfig = field(default_factory=ModelConfig)
    startup: StartupConfig = field(default_factory=StartupConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    # Services by name; the name is also the key here.
    services: dict[str, ServiceConfig] = field(default_factory=dict)

    def service(self, name: str) -> ServiceConfig:
        if name not in self.services:
            raise ConfigError(f"services.{name}: no such service (have: {', '.join(self.services)})")
        return self.services[name]

    def services_of(self, kind: str) -> list[ServiceConfig]:
        return [s for s in self.services.values() if s.kind == kind]

    def capabilities(self) -> list[str]:
        """The public capabilities this deploy file serves: those whose stage kinds are all deployed."""
        deployed = {s.kind for s in self.services.values()}
        return [name for name, kinds in CAPABILITIES.items() if set(kinds) <= deployed]

    def dial_host(self, bind_host: str) -> str:
        """Where a server bound to `bind_host` is reached: that address, or `host` for a wildcard."""
        return self.host if bind_host in WILDCARD_HOSTS else bind_host

    def address(self, name: str) -> str:
        """HOST:PORT of a service's main port (its API), as other processes dial it."""
        svc = self.service(name)
        return join_host_port(self.dial_host(svc.bind_host), svc.port)

    def admin_address(self, name: str) -> str:
        """HOST:PORT of a service's admin port (Control), or '' when it has none."""
        svc = self.service(name)
        return join_host_port(self.dial_host(svc.admin_host), svc.admin_port) if svc.admin_port else ""

    def validated(self) -> DeployConfig:
        """This config checked whole (the first problem raises), each service named after its key."""
        if self.version != 1:
            raise ConfigError(f"version: expected 1, got {self.version}")
        self.startup.validate("startup")
        self.supervision.validate("supervision")
        self.devices.validate("devices")
        ports: dict[int, str] = {}
        services = {}
        for name, svc in self.services.items():
            p = f"services.{name}"
            if svc.name and svc.name != name:
                raise ConfigError(f"{p}.name: must equal the key {name!r}, got {svc.name!r}")
            svc = dataclasses.replace(svc, name=name)
            svc.claim_ports(p, ports)
            svc.validate(p)
            services[name] = svc
        gateways = [n for n, s in services.items() if s.kind == "gateway"]
        if len(gateways) > 1:
            raise ConfigError(f"services: at most one gateway, got {', '.join(gateways)}")
        return dataclasses.replace(self, services=services)
