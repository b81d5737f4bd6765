"""The `omnistage` command: serve, generate, bench, status, health, drain, resume, stage-key, keys,
make-tiny-checkpoint, make-config-checkpoint, protos; one module per command group. Commands of a
running deployment take it from `--config` (+ `--set`), else from this user's running `serve`."""

import sys

from omnistage.common import stop_signals

if sys.argv[1:2] == ["serve"]:  # before the imports below: a stop asked meanwhile is kept (stop_signals.py)
    stop_signals.defer()

from omnistage.common.cli.commands import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]
