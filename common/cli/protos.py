"""`omnistage protos`: regenerate (or `--check`) the code generated from protos/."""

from __future__ import annotations

import argparse
import sys

from omnistage.common.cli.flags import Subparsers


def cmd_protos(args: argparse.Namespace) -> int:
    from omnistage.common import protogen

    if args.check:
        problems = protogen.check()
        for line in problems:
            print(f"omnistage protos: {line}", file=sys.stderr)
        if not problems:
            print("omnistage protos: generated code is up to date")
        return 1 if problems else 0
    files = protogen.write()
    print(f"omnistage protos: wrote {len(files)} files to {files[0].parent}")
    return 0


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("protos", help="regenerate omnistage/v1 *_pb2 code from the .proto files")
    p.add_argument("--check", action="store_true", help="exit 1 when the committed generated code is stale")
    p.set_defaults(fn=cmd_protos)
