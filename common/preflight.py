"""What `omnistage serve` checks before it starts anything, so a mistake costs a second, not a weight
load: the checkpoint exists, every secret the deploy file names can be read, and every port a
service will bind is free. Each problem is one line naming the config key and what to do."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from omnistage.common.config import DeployConfig
from omnistage.common.runtime.auth import check_secrets
from omnistage.common.stages import MODEL_KINDS


def checkpoint_problems(cfg: DeployConfig) -> list[str]:
    """model.checkpoint must be a directory with config.json and safetensors weights, when a stage loads it
    (with `model.load_format: dummy`, config.json and the tokenizer: the weights are made at start-up)."""
    users = [s.name for s in cfg.services.values() if s.kind in MODEL_KINDS]
    if not users:
        return []
    ckpt = Path(cfg.model.checkpoint)
    dummy = cfg.model.load_format == "dummy"
    if dummy:
        make = f"make a config-only one with `omnistage make-config-checkpoint {cfg.model.checkpoint}`"
    else:
        make = f"make the tiny demo one with `omnistage make-tiny-checkpoint {cfg.model.checkpoint}`"
    if not ckpt.is_dir():
        missing = f"{ckpt} does not exist" if not ckpt.exists() else f"{ckpt} is not a directory"
    elif not (ckpt / "config.json").is_file():
        missing = f"{ckpt} has no config.json"
    elif dummy and not (ckpt / "tokenizer.json").is_file():
        missing = f"{ckpt} has no tokenizer.json (load_format dummy still needs the tokenizer)"
    elif not dummy and not any(ckpt.glob("*.safetensors")):
        missing = f"{ckpt} has no *.safetensors weights"
    else:
        return []
    return [
        f"model.checkpoint: {missing} (needed by {', '.join(users)}); {make}, or point model.checkpoint "
        "at a downloaded checkpoint"
    ]


def planned_ports(cfg: DeployConfig) -> list[tuple[str, str, int]]:
    """(config key, bind host, port) of every port the deployment will listen on."""
    ports = []
    for svc in cfg.services.values():
        p = f"services.{svc.name}"
        ports.append((f"{p}.port", svc.bind_host, svc.port))
        if svc.admin_port:
            ports.append((f"{p}.admin_port", svc.admin_host, svc.admin_port))
        if svc.metrics_port:
            ports.append((f"{p}.metrics_port", cfg.host, svc.metrics_port))
        if svc.gateway.http_port:
            ports.append((f"{p}.gateway.http_port", svc.bind_host, svc.gateway.http_port))
        if svc.dist_port:  # the config reserves one port per TP rank
            for rank in range(svc.tp_size):
                ports.append(
                    (f"{p}.dist_port" + (f"+{rank}" if rank else ""), cfg.host, svc.dist_port + rank)
                )
    return ports


def port_in_use(host: str, port: int) -> str:
    """'' when `host:port` can be bound now; else the reason.

    Binds with SO_REUSEADDR on and SO_REUSEPORT off, as our servers do: on Linux that still fails
    on any listener of the port, but not on the TIME_WAIT connections a just-stopped server leaves
    (with SO_REUSEADDR off, a restart would be refused for a minute though the server would bind).
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc}"
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(AttributeError, OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 0)
        sock.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        sock.close()
    return ""


def port_problems(cfg: DeployConfig) -> list[str]:
    problems = []
    for key, host, port in planned_ports(cfg):
        why = port_in_use(host, port)
        if why:
            problems.append(f"{key} {port} is in use ({host}:{port}: {why})")
    return problems


def preflight(cfg: DeployConfig) -> list[str]:
    """Every problem that would make the deployment fail to start; empty when it may start."""
    problems = checkpoint_problems(cfg)
    for svc in cfg.services.values():
        problems += check_secrets(svc)
    return problems + port_problems(cfg)
