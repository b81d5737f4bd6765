"""`omnistage status`, `health`, `drain` and `resume`: an operator's commands of a running deployment."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.cli.flags import Subparsers, config_args
from omnistage.common.cli.targets import deploy_config, from_run, key_from
from omnistage.common.cli.terminal import terminal_safe
from omnistage.common.config import ConfigError, DeployConfig, ServiceConfig
from omnistage.common.runtime import auth
from omnistage.common.runtime.auth import SecretError
from omnistage.v1 import control_pb2, control_pb2_grpc


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _health(address: str, timeout_s: float) -> str:
    """`SERVING`, `NOT_SERVING`, or `unreachable: CODE: details`."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return f"unreachable: {exc.code().name}: {exc.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when one process is SERVING, 1 otherwise (one line on stdout): container health checks.

    ADDRESS asks grpc.health.v1 (the whole server, `service=""`) on a main or admin port;
    `--status-file` reads the status file a process without a gRPC server writes (thinker ranks > 0).
    """
    if bool(args.address) == bool(args.status_file):
        print("omnistage health: give ADDRESS (HOST:PORT) or --status-file FILE", file=sys.stderr)
        return 2
    if args.status_file:
        from omnistage.common.runtime.status_file import read_status

        rec = read_status(Path(args.status_file))
        if rec is None:
            print(f"{args.status_file}: no status yet")
            return 1
        phase = f"failed in {rec.failed_in}: {rec.failure}" if rec.phase == "failed" else rec.phase
        print(f"{rec.service} r{rec.rank} (pid {rec.pid}): {phase}")
        return 0 if rec.phase == "serving" else 1
    health = _health(args.address, args.timeout_s)
    print(f"{args.address}: {health}")
    return 0 if health == "SERVING" else 1


def describe_lines(address: str, timeout_s: float, metadata: tuple = ()) -> tuple[bool, list[str]]:
    """Human-readable Describe + health of one service at its admin address; (serving?, lines)."""
    with grpc.insecure_channel(address) as channel:
        try:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
            d = control_pb2_grpc.ControlStub(channel).Describe(
                control_pb2.DescribeRequest(), timeout=timeout_s, metadata=metadata
            )
        except grpc.RpcError as exc:
            return False, [f"{address}  unreachable: {exc.code().name}: {exc.details()}"]
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    p = d.progress
    phase = control_pb2.Phase.Name(p.phase).removeprefix("PHASE_").lower()
    count = f" {p.done}/{p.total} {p.unit}" if p.total else (f" {p.done} {p.unit}" if p.done else "")
    kind = control_pb2.StageKind.Name(d.kind).removeprefix("STAGE_KIND_").lower()
    lines = [
        f"{d.name} ({kind}) admin {address}: {status}, phase {phase}{count} ({p.elapsed_s:.1f}s)"
        + (f" {p.detail}" if p.detail else ""),
        f"  version {d.version}, rank {d.rank}/{d.world_size}, pid {d.pid}, config {d.config_hash[:12]}"
        + (f", model {d.model}" if d.model else ""),
        f"  requests: {d.running_requests} running, {d.queued_requests} queued",
    ]
    lim = d.limits
    lines.append(
        f"  limits: max_running {lim.max_running_requests}, max_queued {lim.max_queued_requests}, "
        f"max_message {_mib(lim.max_message_bytes)}"
        + (
            f", max_model_len {lim.max_model_len}, default_max_tokens {lim.default_max_tokens}"
            if lim.max_model_len
            else ""
        )
    )
    for m in d.memory:
        lines.append(
            f"  memory {m.device}: total {_mib(m.total_bytes)} (weights {_mib(m.weights_bytes)}, "
            f"kv {_mib(m.kv_cache_bytes)}, activations {_mib(m.activation_peak_bytes)}, "
            f"graphs {_mib(m.graph_pool_bytes)}, transport {_mib(m.transport_pool_bytes)})"
            + (f", budget {_mib(m.budget_bytes)}" if m.budget_bytes else "")
        )
    for r in d.readiness:  # the gateway: which capabilities it serves now
        lines.append(f"  {r.capability}: " + ("ready" if r.ready else f"not ready ({r.reason})"))
    if d.failure:
        lines.append(f"  failure: {d.failure}")
    return health.status == health_pb2.HealthCheckResponse.SERVING, lines


def service_lines(cfg: DeployConfig, svc: ServiceConfig, timeout_s: float) -> tuple[bool, list[str]]:
    """Status of one service of a deploy file: Describe on its admin port, else its main port's health."""
    admin = cfg.admin_address(svc.name)
    if admin:
        ok, lines = describe_lines(admin, timeout_s, auth.admin_metadata(svc))
        lines[0] += f" (serves at {cfg.address(svc.name)})"
        return ok, lines
    if svc.tls is None:
        health = _health(cfg.address(svc.name), timeout_s)
    else:
        health = "health not checked (TLS)"
    return health == "SERVING", [
        f"{svc.name} ({svc.kind}) at {cfg.address(svc.name)}: {health} "
        f"(no admin port: set services.{svc.name}.admin_port to see its phase)"
    ]


def cmd_status(args: argparse.Namespace) -> int:
    if args.config or not args.address:
        try:
            from_run(args)
            cfg = deploy_config(args)
            results = [service_lines(cfg, svc, args.timeout_s) for svc in cfg.services.values()]
        except (ConfigError, SecretError) as exc:
            print(f"omnistage: {exc}", file=sys.stderr)
            return 2
    else:
        try:
            metadata = (
                key_from(args.admin_key_env, "--admin-key-env")
                if args.admin_key_env
                else _stage_key(args.address)
            )
        except SecretError as exc:
            print(f"omnistage: {exc}", file=sys.stderr)
            return 2
        results = [describe_lines(args.address, args.timeout_s, metadata)]
    all_ok = True
    for ok, lines in results:
        all_ok &= ok
        print(terminal_safe("\n".join(lines)))  # phase details and failures quote what services say
    return 0 if all_ok else 1


def _stage_key(address: str) -> tuple[tuple[str, str], ...]:
    """What `status --address` presents without --admin-key-env: the stage key ($OMNISTAGE_STAGE_KEY,
    else the one left by this user's running `serve` that has that port), which a stage's admin port
    takes as its admin key."""
    key = auth.stage_key()
    if not key:
        from omnistage.common import run_record

        record = run_record.with_address(address)
        key = auth.published_stage_key(record.config) if record is not None else ""
    return auth.bearer(key) if key else ()


def _control(args: argparse.Namespace) -> tuple[ServiceConfig, str, tuple]:
    """(service, admin address, metadata) of `--service` in `--config`."""
    cfg = deploy_config(args)
    svc = cfg.service(args.service)
    address = cfg.admin_address(svc.name)
    if not address:
        raise ConfigError(
            f"services.{svc.name}.admin_port: not set; Control (Drain, Resume) is served only there"
        )
    return svc, address, auth.admin_metadata(svc)


def _call_control(
    args: argparse.Namespace, rpc: str, request: Any, timeout_s: Callable[[ServiceConfig], float]
) -> tuple[ServiceConfig, Any] | int:
    """Control.<rpc> on the admin port of `--service`: (service, reply), or the exit code once the
    reason is printed (2: the config or the admin key, 1: the call)."""
    try:
        from_run(args)
        svc, address, metadata = _control(args)
    except (ConfigError, SecretError) as exc:
        print(f"omnistage: {exc}", file=sys.stderr)
        return 2
    with grpc.insecure_channel(address) as channel:
        try:
            call = getattr(control_pb2_grpc.ControlStub(channel), rpc)
            return svc, call(request, timeout=timeout_s(svc), metadata=metadata)
        except grpc.RpcError as exc:
            print(f"omnistage: {rpc.lower()} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1


def cmd_drain(args: argparse.Namespace) -> int:
    def timeout_s(svc: ServiceConfig) -> float:
        return (args.deadline_ms / 1000 if args.deadline_ms else svc.drain_grace_s) + 30.0

    result = _call_control(args, "Drain", control_pb2.DrainRequest(deadline_ms=args.deadline_ms), timeout_s)
    if isinstance(result, int):
        return result
    svc, reply = result
    resume = [
        "omnistage",
        "resume",
        "--config",
        args.config,
        *(w for o in args.overrides for w in ("--set", o)),
        "--service",
        svc.name,
    ]
    print(
        f"omnistage: {svc.name} draining: {reply.completed} requests finished, {reply.aborted} aborted; "
        f"new requests get UNAVAILABLE until `{shlex.join(resume)}`"
    )
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    result = _call_control(args, "Resume", control_pb2.ResumeRequest(), lambda svc: args.timeout_s)
    if isinstance(result, int):
        return result
    print(f"omnistage: {result[0].name} serving again")
    return 0


def _service_args(p: argparse.ArgumentParser) -> None:
    """One service of a deploy file (drain, resume)."""
    config_args(p)
    p.add_argument("--service", required=True, help="service name (key under services:)")


def add_parsers(sub: Subparsers) -> None:
    """status, health, drain and resume: the commands of an operator of a running deployment."""
    p = sub.add_parser(
        "status", help="phase, health and limits of every service of a deploy file (or one admin address)"
    )
    config_args(p)
    p.add_argument(
        "--address", metavar="ADMIN_HOST:PORT", help="one service's admin port instead of --config"
    )
    p.add_argument(
        "--admin-key-env", metavar="VAR", help="with --address: environment variable holding the admin key"
    )
    p.add_argument("--timeout-s", type=float, default=2.0)
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser(
        "health",
        help="exit 0 when a service is SERVING (grpc.health.v1), 1 otherwise: container health checks",
    )
    p.add_argument("address", nargs="?", metavar="HOST:PORT", help="a main or admin port (plaintext)")
    p.add_argument(
        "--status-file",
        metavar="FILE",
        help="instead: the status file of a process without a gRPC server (<run-dir>/<service>.r<rank>.json)",
    )
    p.add_argument("--timeout-s", type=float, default=2.0)
    p.set_defaults(fn=cmd_health)

    p = sub.add_parser("drain", help="stop one service taking requests (Control.Drain on its admin port)")
    _service_args(p)
    p.add_argument(
        "--deadline-ms", type=int, default=0, help="wait this long for in-flight requests (0: drain_grace_s)"
    )
    p.set_defaults(fn=cmd_drain)

    p = sub.add_parser("resume", help="let a drained service take requests again (Control.Resume)")
    _service_args(p)
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.set_defaults(fn=cmd_resume)
