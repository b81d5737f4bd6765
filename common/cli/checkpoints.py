"""`omnistage make-tiny-checkpoint` and `make-config-checkpoint`: checkpoints for tests and benchmarks."""

from __future__ import annotations

import argparse

from omnistage.common.cli.flags import Subparsers


def cmd_make_tiny_checkpoint(args: argparse.Namespace) -> int:
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(args.dir, seed=args.seed)
    print(f"omnistage: tiny checkpoint written to {path}")
    return 0


def cmd_make_config_checkpoint(args: argparse.Namespace) -> int:
    from omnistage.common.checkpoint.config_only import write_config_checkpoint

    path = write_config_checkpoint(args.dir, args.shape)
    print(
        f"omnistage: config-only {args.shape} checkpoint written to {path} (serve it with model.load_format: dummy)"
    )
    return 0


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser(
        "make-tiny-checkpoint", help="write the tiny random-weight checkpoint in the HF layout"
    )
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_make_tiny_checkpoint)

    p = sub.add_parser(
        "make-config-checkpoint",
        help="write the configs of every part at a real shape + tiny tokenizers, no weights (load_format: dummy)",
    )
    p.add_argument("dir")
    p.add_argument(
        "--shape",
        choices=("ming-flash", "ling-mini", "ming-flash-tp2-rank", "tiny"),
        default="ming-flash",
        help="ming-flash-tp2-rank: one rank of Ming-flash at TP=2 as a one-GPU model (benchmarks)",
    )
    p.set_defaults(fn=cmd_make_config_checkpoint)
