"""`omnistage stage-key` and `keys`: the keys of a running deployment and fresh ones for a new one."""

from __future__ import annotations

import argparse
import sys

from omnistage.common.cli.flags import Subparsers, config_args
from omnistage.common.cli.targets import from_run
from omnistage.common.config import ConfigError
from omnistage.common.runtime import auth


def cmd_stage_key(args: argparse.Namespace) -> int:
    """Print the stage key of the running `serve` (of `--config`, else this user's current run): what
    a client calling a stage directly (its main or admin port) presents as `authorization: Bearer`."""
    try:
        from_run(args)
    except ConfigError as exc:
        print(f"omnistage: {exc}", file=sys.stderr)
        return 2
    key = auth.published_stage_key(args.config)
    if not key:
        print(
            f"omnistage: no stage key of a running `omnistage serve {args.config}` for this user "
            f"(a deployment started elsewhere: its ${auth.STAGE_KEY_ENV})",
            file=sys.stderr,
        )
        return 1
    print(key)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from omnistage.common.deploy_keys import write_env_file

    try:
        path = write_env_file(args.env_file, api_keys=args.api_keys, force=args.force)
    except FileExistsError:
        print(f"omnistage: {args.env_file} exists; --force replaces its keys (rotation)", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"omnistage: {exc}", file=sys.stderr)
        return 2
    print(
        f"omnistage: the deployment's keys written to {path} (0600): "
        f"docker-compose --env-file {path} ...; kubectl create secret generic omnistage-keys --from-env-file={path}"
    )
    return 0


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser(
        "stage-key",
        help="print the stage key of this user's running `serve` (for calling a stage's ports directly)",
    )
    config_args(p)
    p.set_defaults(fn=cmd_stage_key)

    p = sub.add_parser(
        "keys", help="write fresh deployment keys (API, admin, stage, Grafana) to a 0600 env file"
    )
    p.add_argument(
        "--env-file",
        required=True,
        metavar="PATH",
        help="docker-compose --env-file / kubectl --from-env-file",
    )
    p.add_argument("--api-keys", type=int, default=1, help="how many client keys OMNISTAGE_API_KEYS holds")
    p.add_argument("--force", action="store_true", help="replace an existing file (new keys)")
    p.set_defaults(fn=cmd_keys)
