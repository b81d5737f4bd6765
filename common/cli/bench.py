"""`omnistage bench`: a closed-loop load sweep of a running gateway (common/load_driver.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import grpc
from omnistage.common.cli.flags import Subparsers, gateway_args
from omnistage.common.cli.targets import call_failure, gateway_target
from omnistage.common.config import ConfigError
from omnistage.common.load_driver import KINDS, RequestShape, plan, run_plan
from omnistage.common.load_stats import Summary, details_table, failures, markdown_table
from omnistage.common.runtime.auth import SecretError
from omnistage.v1 import omni_pb2_grpc


def cmd_bench(args: argparse.Namespace) -> int:
    """Closed-loop sweep of a running gateway with the load harness's driver (load_driver.py): one table
    row per concurrency and kind as it finishes, then the latency details; exit 1 on any error."""
    try:
        address, creds, metadata = gateway_target(args)
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if not levels or min(levels) < 1:
            raise ValueError(
                f"--concurrency: expected positive integers like 1,2,4, got {args.concurrency!r}"
            )
        kinds = [k for k in args.kinds.split(",") if k]
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(f"--kinds: a comma-separated list of {', '.join(KINDS)}, got {args.kinds!r}")
    except (ConfigError, SecretError, OSError, ValueError) as exc:
        print(f"omnistage: {exc}", file=sys.stderr)
        return 2
    shape = RequestShape(
        max_tokens=args.max_tokens,
        deadline_s=args.deadline_s,
        timeout_s=args.timeout_s,
        prompt=args.prompt,
        metadata=tuple(metadata),
    )
    print(f"omnistage bench: {address}, {args.requests} requests per level, max_tokens={args.max_tokens}")
    print("\n".join(markdown_table([]).splitlines()[:2]), flush=True)
    try:
        summaries = asyncio.run(
            _bench(address, creds, list(plan(kinds, ["closed"], levels)), args.requests, shape)
        )
    except grpc.RpcError as exc:  # the unmeasured first request of a kind
        print(call_failure("bench", exc, address), file=sys.stderr)
        return 1
    print("\n" + details_table(summaries))
    if args.json:
        Path(args.json).write_text(json.dumps([s.to_json() for s in summaries], indent=1))
    problems = failures(summaries)
    if problems:  # the exit status says "failed": stderr says which requests and why
        print(
            "omnistage bench: exit 1, requests that did not finish as asked (an error status, a failed "
            "finish, or speech not complete):",
            file=sys.stderr,
        )
        print("\n".join(f"  {line}" for line in problems), file=sys.stderr)
    return 1 if problems else 0


async def _bench(
    address: str,
    creds: grpc.ChannelCredentials | None,
    runs: list[tuple[str, str, str]],
    requests: int,
    shape: RequestShape,
) -> list[Summary]:
    options = [("grpc.max_receive_message_length", 64 << 20)]
    channel = (
        grpc.aio.secure_channel(address, creds, options)
        if creds is not None
        else grpc.aio.insecure_channel(address, options)
    )
    async with channel:
        return await run_plan(
            omni_pb2_grpc.OmniStub(channel),
            runs,
            requests,
            shape,
            on_summary=lambda s: print(markdown_table([s]).splitlines()[-1], flush=True),
        )


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser(
        "bench",
        help="closed-loop load sweep against a running gateway (load_tests/pipeline_load.py's driver)",
    )
    gateway_args(p)
    p.add_argument(
        "--kinds",
        default="text",
        help="comma-separated request kinds: text, vision (image + text in), speech, image, mixed",
    )
    p.add_argument("--concurrency", default="1,2,4", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=16, help="requests per level (at least the concurrency)")
    p.add_argument("--prompt", default="", help="the prompt of every request (default: one per kind)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (ignore_eos)")
    p.add_argument(
        "--deadline-s", type=float, default=30.0, help="goodput: a request OK within this many seconds"
    )
    p.add_argument("--json", metavar="FILE", help="also write every level's summary as JSON")
    p.set_defaults(fn=cmd_bench)
