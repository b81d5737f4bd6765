"""The common `main()` of every service process: `services/<kind>/__main__.py` is one call to `run_service`.

It parses the launcher's arguments, sets up logging, makes sure the process never outlives its
launcher, binds the server, runs the service's `build` coroutine and turns any failure into phase
`failed` + status file + one diagnostic line on stderr + a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

from omnistage.common.config import STARTUP_PHASES, ConfigError, DeployConfig, ServiceConfig, load_config
from omnistage.common.log import setup_logging
from omnistage.common.runtime import blocking
from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.orphan import before_exit, die_with_launcher, watch_parent
from omnistage.common.runtime.server import ServiceRuntime

_log = logging.getLogger(__name__)

BuildFn = Callable[[ServiceRuntime, DeployConfig, ServiceConfig, int], Awaitable[None]]
# The main port's receive limit of a service that knows its largest legitimate request (the gateway).
ReceiveBytesFn = Callable[[DeployConfig, ServiceConfig], int]
# How long a cancelled build gets to unwind when a stop arrives during start-up.
_BUILD_CANCEL_WAIT_S = 5.0
# Once stopped, how long the rest may take (the event loop's clean-up, the exit handlers) before the
# process ends itself with its code: the launcher must not find a stopped service still running
# ("ignored SIGTERM, killing") because a clean-up did not end.
_EXIT_WAIT_S = 1.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="omnistage-service", description="Run one omnistage service process.")
    p.add_argument("--config", required=True, help="deploy YAML")
    p.add_argument("--service", required=True, help="service name (key under services:)")
    p.add_argument("--rank", type=int, default=0, help="TP rank of this process")
    p.add_argument("--run-dir", default=None, help="directory of the status files the launcher reads")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(list(argv))


async def serve(runtime: ServiceRuntime, build: BuildFn) -> int:
    """Start, build, serve until stopped. Returns the exit code; failures are reported, not raised."""
    try:
        await runtime.start()
        runtime.install_signal_handlers()
        runtime.reporter.enter("starting", detail="server bound")
        build_task = asyncio.create_task(build(runtime, runtime.cfg, runtime.svc, runtime.rank))
        stop_task = asyncio.create_task(runtime.wait_stop_requested())
        await asyncio.wait({build_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if not build_task.done():  # SIGTERM during start-up: abandon the build
            build_task.cancel()
            await asyncio.wait({build_task}, timeout=_BUILD_CANCEL_WAIT_S)
        else:
            stop_task.cancel()
            build_task.result()
            if runtime.phase in STARTUP_PHASES:
                runtime.set_serving()
        return await runtime.serve_until_stopped()
    except Exception as exc:
        phase = runtime.reporter.snapshot().failed_in or runtime.phase  # failed already: where it was
        cause = f"{type(exc).__name__}: {exc}"
        _log.error("failed in %s: %s", phase, cause, exc_info=exc)
        # A TP rank that leaves because of another rank's failure names that rank (`culprit_rank`),
        # so the launcher blames the rank at fault, whichever rank's status it reads first.
        runtime.fail(cause, getattr(exc, "culprit_rank", None))
        print(
            f"omnistage: {runtime.name} r{runtime.rank} failed in {phase}: {cause}",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(Exception):
            await within(runtime.shutdown(), _BUILD_CANCEL_WAIT_S)
        return 1


async def _serve_then_exit(runtime: ServiceRuntime, build: BuildFn) -> int:
    """`serve`, then a timer that ends the process `_EXIT_WAIT_S` later if its clean-up has not."""
    code = await serve(runtime, build)

    def exit_now() -> None:
        _log.warning(
            "still running %.1fs after stopping (a clean-up that does not end): exiting", _EXIT_WAIT_S
        )
        _exit_flushed(code)

    timer = threading.Timer(_EXIT_WAIT_S, exit_now)
    timer.daemon = True
    timer.start()
    return code


def _exit_flushed(code: int) -> NoReturn:
    """End the process now, without the interpreter's finalization, its output flushed."""
    before_exit()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_service(
    argv: Sequence[str], kind: str | None, build: BuildFn, receive_bytes: ReceiveBytesFn | None = None
) -> NoReturn:
    """Entry point of a service process; `kind` (None: any) must match the configured kind.

    `build(runtime, cfg, svc, rank)` loads and warms up the service, registering its API with
    `runtime.add_servicer`; it runs on the event loop, so blocking steps belong in
    `asyncio.to_thread` (health and Describe keep answering meanwhile). When it returns, the service
    is SERVING (set for it unless it already called `runtime.set_serving()`); it may also keep
    running (a TP worker loop) and is cancelled on SIGTERM. A worker whose loop ends on its own
    calls `runtime.request_stop()`. Any exception: phase failed, one stderr line, exit 1.
    `receive_bytes(cfg, svc)`: the main port's gRPC receive limit (default: max_message_bytes).
    """
    die_with_launcher()  # done already when `omnistage.services` was imported; scripts (tests) come here
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        svc = cfg.service(args.service)
        if kind is not None and svc.kind != kind:
            raise ConfigError(f"services.{svc.name}.kind: is {svc.kind!r}, this program serves {kind!r}")
        if not 0 <= args.rank < svc.tp_size:
            raise ConfigError(f"--rank {args.rank}: services.{svc.name}.tp_size is {svc.tp_size}")
    except ConfigError as exc:
        print(f"omnistage: {args.service} r{args.rank}: config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    setup_logging(svc.name, args.rank, cfg.log_level, cfg.log_format)
    watch_parent()
    receive = receive_bytes(cfg, svc) if receive_bytes is not None else None
    runtime = ServiceRuntime(cfg, svc, args.rank, run_dir=args.run_dir, max_receive_bytes=receive)
    code = asyncio.run(_serve_then_exit(runtime, build))
    # Stopped already: a late SIGTERM (the launcher stopping the other ranks) must not turn this clean
    # exit into "killed by SIGTERM" while the interpreter finalizes; a stuck exit still meets SIGKILL.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    # Everything the service owns is released by now. The interpreter's finalization is never run: it
    # would tear down torch's C++ state under threads that may still run (a blocking load stopped
    # half-way, see blocking.py; gloo's threads of a TP rank: 'SIGABRT while stopping' under load).
    # The exit handlers (shared-memory pools) run, then the process ends with its code.
    busy = blocking.busy()
    if busy:
        logging.getLogger(__name__).info("exiting with %s still running", ", ".join(busy))
    atexit._run_exitfuncs()
    _exit_flushed(code)
