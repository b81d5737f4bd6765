"""The `omnistage` command: serve, generate, bench, status, health, drain, resume, stage-key, keys,
make-tiny-checkpoint, make-config-checkpoint, protos; one module per command group. Commands of a
running deployment take it from `--config` (+ `--set`), else from this user's running `serve`."""

from omnistage.common.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
