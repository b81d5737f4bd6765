"""The `omnistage` parser, one command group per module, and `main`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import omnistage.common.cli.admin as admin
import omnistage.common.cli.bench as bench
import omnistage.common.cli.checkpoints as checkpoints
import omnistage.common.cli.generate as generate
import omnistage.common.cli.keys as keys
import omnistage.common.cli.protos as protos
import omnistage.common.cli.serve as serve
from omnistage.common.runtime.control import omnistage_version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnistage", description="Stage-wise gRPC serving of omni-modal models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (serve, checkpoints, generate, bench, admin, keys, protos):
        group.add_parsers(sub)
    version = f"omnistage {omnistage_version()}"
    for p in (parser, *sub.choices.values()):
        p.add_argument("--version", action="version", version=version)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
        sys.stdout.flush()  # here, not at exit: a reader that left is seen where it can be handled
        return code
    except BrokenPipeError:  # `omnistage status | head`: the reader left; no traceback, the shell's code
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
        return 141
