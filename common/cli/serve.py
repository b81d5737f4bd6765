"""`omnistage serve`: start a deploy file's services (common/launcher/)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from omnistage.common.cli.flags import Subparsers, overrides_arg
from omnistage.common.config import ConfigError, load_config

if TYPE_CHECKING:
    pass


def cmd_serve(args: argparse.Namespace) -> int:
    from omnistage.common.launcher import launch

    return launch(
        args.config,
        [*args.overrides, *_public_port_overrides(args)],
        run_dir=args.run_dir,
        ready_file=args.ready_file,
        exit_after_ready=args.exit_after_ready,
        check_only=args.check,
    )


def _public_port_overrides(args: argparse.Namespace) -> list[str]:
    """`serve --host/--port/--http-port` as the `--set` overrides of the gateway they move (recorded
    with the run like any other, so the other commands find the moved ports)."""
    flags = {"bind_host": args.host, "port": args.port, "gateway.http_port": args.http_port}
    if all(v is None for v in flags.values()):
        return []
    try:
        gateways = load_config(args.config, args.overrides).services_of("gateway")
    except ConfigError:
        return []  # `serve` reports the config's problem itself
    if not gateways:
        return []
    name = gateways[0].name
    return [f"services.{name}.{key}={value}" for key, value in flags.items() if value is not None]


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="start every service of a deploy file and supervise them")
    p.add_argument("config", help="deploy YAML (e.g. deploy/local-tiny.yaml)")
    overrides_arg(p, "override a config key (repeatable)")
    p.add_argument("--host", default=None, help="address the gateway's public ports bind (its bind_host)")
    p.add_argument("--port", type=int, default=None, help="the gateway's gRPC port (its port)")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="the gateway's OpenAI-compatible HTTP port (gateway.http_port)",
    )
    p.add_argument("--run-dir", default=None, help="directory for status files (default: a temp dir)")
    p.add_argument("--ready-file", default=None, help="write the gateway address here when ready")
    p.add_argument("--exit-after-ready", action="store_true", help="stop everything once ready (smoke tests)")
    p.add_argument(
        "--check",
        action="store_true",
        help="check the config, the per-GPU memory ledger, the checkpoint, secrets and ports; start nothing",
    )
    p.set_defaults(fn=cmd_serve)
