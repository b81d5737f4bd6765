"""The flags several commands share: which deployment (`--config`, `--set`), which gateway and how."""

from __future__ import annotations

import argparse
from typing import Any

Subparsers = Any  # argparse's _SubParsersAction (private)


def config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="deploy YAML (the one `serve` runs; default: this user's running `serve`)"
    )
    overrides_arg(p, "the same overrides as `serve` (repeatable)")


def overrides_arg(p: argparse.ArgumentParser, help_text: str) -> None:
    """`--set KEY.PATH=VALUE` (repeatable) into `args.overrides`: `serve`'s and every command's that reads its config."""
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE", help=help_text
    )


def gateway_args(p: argparse.ArgumentParser) -> None:
    """Where and how a client command (generate, bench) calls the gateway."""
    config_args(p)
    p.add_argument("--address", metavar="HOST:PORT", help="the gateway (default: from --config)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each request")
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="environment variable holding the API key (default: the gateway's api_keys_env / api_keys_file)",
    )
    p.add_argument(
        "--ca-file", default="", help="TLS: CA to trust (default with --config: the gateway's certificate)"
    )
    p.add_argument("--cert-file", default="", help="TLS: client certificate (mutual TLS)")
    p.add_argument("--key-file", default="", help="TLS: client key (mutual TLS)")
