"""Which deployment a command talks to: `--config` (+ `--set`), else this user's running `serve`
(run_record.py); the gateway `generate` and `bench` call, with its TLS and key."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

import grpc
from omnistage.common.config import ConfigError, DeployConfig, load_config
from omnistage.common.runtime import auth
from omnistage.common.runtime.auth import SecretError

if TYPE_CHECKING:
    pass


def from_run(args: argparse.Namespace) -> None:
    """Without --config (and --address), the deployment of this user's running `serve` (run_record.py):
    its config and `--set` overrides, the command's own after them. ConfigError when neither is given
    and no `serve` runs, or several do (never a guess: it names them)."""
    if getattr(args, "config", None) or getattr(args, "address", None):
        return
    from omnistage.common import run_record

    records = run_record.running()
    where = "--config FILE" + (" or --address HOST:PORT" if hasattr(args, "address") else "")
    if not records:
        raise ConfigError(f"give {where} (no running `omnistage serve` of this user found)")
    if len(records) > 1:
        listed = "".join(f"\n  {run_record.describe(r)}" for r in records)
        raise ConfigError(
            f"{len(records)} `omnistage serve` of this user are running; give {where} to say which "
            f"(with the --set it was given):{listed}"
        )
    (record,) = records
    args.config = record.config
    args.overrides = [*record.overrides, *args.overrides]


def deploy_config(args: argparse.Namespace) -> DeployConfig:
    """The deploy file of `--config` with its `--set` overrides (ConfigError names the key); the stage
    key its running `serve` left is taken too (stages answer Control only with it)."""
    cfg = load_config(args.config, args.overrides)
    auth.adopt_stage_key(args.config)
    return cfg


def key_from(var: str, flag: str) -> tuple[tuple[str, str], ...]:
    key = os.environ.get(var, "").strip()
    if not key:
        raise SecretError(f"{flag} {var}: environment variable {var} is not set")
    return auth.bearer(key)


def gateway_target(args: argparse.Namespace) -> tuple[str, grpc.ChannelCredentials | None, tuple]:
    """(address, TLS credentials or None, call metadata) of the gateway `generate` talks to."""
    key_env = args.api_key_env
    from_run(args)
    if args.config:
        cfg = deploy_config(args)
        gateways = cfg.services_of("gateway")
        if not gateways:
            raise ConfigError(f"services: {args.config} has no gateway to send the prompt to")
        gw = gateways[0]
        address = args.address or cfg.address(gw.name)
        creds = auth.channel_credentials(gw, args.ca_file, args.cert_file, args.key_file)
        metadata = key_from(key_env, "--api-key-env") if key_env else auth.client_metadata(gw)
        return address, creds, metadata
    if not args.address:
        raise ConfigError("give --config FILE (the gateway is found there) or --address HOST:PORT")
    creds = None
    if args.ca_file or args.cert_file:
        creds = auth.tls_credentials(args.ca_file, args.cert_file, args.key_file)
    return args.address, creds, key_from(key_env, "--api-key-env") if key_env else ()


def call_failure(command: str, exc: grpc.RpcError, address: str) -> str:
    """`omnistage: generate failed: CODE: details`, with what to do when the address is wrong: nothing
    listens there (is `serve` running?), or it is a stage's port, not the gateway's."""
    line = f"omnistage: {command} failed: {exc.code().name}: {exc.details()}"
    if exc.code() == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or "").lower():
        return f"{line}\nomnistage: nothing answers at {address}: is `omnistage serve` running (`omnistage status`)?"
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return f"{line}\nomnistage: {address} serves no omnistage.v1.Omni: {_gateway_hint(address)}"
    return line


def _gateway_hint(address: str) -> str:
    """Where the gateway is, as far as this user's running `serve`s tell."""
    from omnistage.common import run_record

    record = run_record.with_address(address)
    if record is not None and record.gateway:
        names = [name for name, admin in record.admin.items() if admin == address]
        what = f"the admin port of {names[0]}" if names else "a stage's port"
        return f"it is {what}; the gateway of that `serve` is at {record.gateway}"
    return "a stage's port? The gateway's public port is the gateway service's `port` (`omnistage status` lists them)"
