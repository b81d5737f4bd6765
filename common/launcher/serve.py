"""`launch()`: the checks before anything starts, the run's records for the CLI, signals, clean-up."""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from omnistage.common import run_record, stop_signals
from omnistage.common.config import ConfigError, DeployConfig, load_config
from omnistage.common.launcher.run import Launcher
from omnistage.common.preflight import preflight
from omnistage.common.runtime import auth
from omnistage.common.stages import MODULES

if TYPE_CHECKING:
    from omnistage.common.memory.ledger import LedgerReport

# The stale-shm sweep runs beside the start; the launcher waits at most this long for it at exit.
_SWEEP_WAIT_S = 30.0


def launch(
    cfg_path: str | Path,
    overrides: Sequence[str] = (),
    *,
    run_dir: str | Path | None = None,
    modules: dict[str, str] | None = None,
    ready_file: str | Path | None = None,
    exit_after_ready: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    check_only: bool = False,
) -> int:
    """Run a deployment until SIGTERM/SIGINT (0), a failed start or a dead service (1), a bad config (2).

    Before anything starts: the config, the per-GPU memory ledger, then the checkpoint, every secret
    the config names and every port it binds (`preflight`), each refused with one line naming the key.
    `check_only` (`serve --check`): those checks and the ledger's table, then 0; nothing starts.

    `modules` maps stage kinds to a module name or a script path (tests substitute synthetic stages).
    """
    out, err = out or sys.stdout, err or sys.stderr
    checked = _checked_deploy(cfg_path, overrides, err)
    if isinstance(checked, int):
        return checked
    cfg, ledger = checked
    if check_only:
        _print_checked(cfg_path, cfg, ledger, out)
        return 0
    if ledger.devices:
        print(ledger.summary(), file=out, flush=True)
    sweep = _start_sweep(err)
    own_run_dir = run_dir is None
    rdir = Path(tempfile.mkdtemp(prefix="omnistage-run-")) if run_dir is None else Path(run_dir)
    rdir.mkdir(parents=True, exist_ok=True)
    launcher = Launcher(
        cfg, Path(cfg_path).resolve(), overrides, rdir, {**MODULES, **(modules or {})}, out, err
    )
    previous = _install_signals(launcher)
    key_file = _publish_stage_key(cfg_path, launcher.stage_key, err)
    record = _publish_run(cfg, cfg_path, overrides, rdir, err)
    try:
        return launcher.run(Path(ready_file) if ready_file else None, exit_after_ready)
    except ConfigError as exc:
        print(f"omnistage: config error: {exc}", file=err, flush=True)
        return 2
    finally:
        if key_file is not None:
            auth.withdraw_stage_key(key_file, launcher.stage_key)
        if record is not None:
            run_record.withdraw(record)
        sweep.join(timeout=_SWEEP_WAIT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if own_run_dir:
            shutil.rmtree(rdir, ignore_errors=True)


def _checked_deploy(
    cfg_path: str | Path, overrides: Sequence[str], err: TextIO
) -> tuple[DeployConfig, LedgerReport] | int:
    """The config, its per-GPU memory ledger and `preflight`, checked before anything starts.

    Returns the config and its ledger, or 2 after one line per problem on `err`.
    """
    try:
        cfg = load_config(cfg_path, list(overrides))
    except ConfigError as exc:
        print(f"omnistage: config error: {exc}", file=err, flush=True)
        return 2
    if not cfg.services:
        print(f"omnistage: config error: services: {cfg_path} has no services to start", file=err, flush=True)
        return 2
    from omnistage.common.memory.ledger import LedgerError, check_deploy_memory

    try:  # the per-GPU memory ledger: refuse before anything starts
        ledger = check_deploy_memory(cfg)
    except LedgerError as exc:
        print(f"omnistage: {exc}", file=err, flush=True)
        return 2
    problems = preflight(cfg)  # checkpoint, secrets, ports: before anything starts or loads
    if problems:
        for line in problems:
            print(f"omnistage: {line}", file=err, flush=True)
        return 2
    return cfg, ledger


def _print_checked(cfg_path: str | Path, cfg: DeployConfig, ledger: LedgerReport, out: TextIO) -> None:
    """`serve --check`'s answer: the ledger's table and one line saying nothing started."""
    print(ledger.table() if ledger.devices else "memory ledger: no device budgets", file=out)
    print(
        f"omnistage: {cfg_path}: the config, memory ledger, checkpoint, secrets and ports are fine "
        f"({len(cfg.services)} services); nothing started",
        file=out,
        flush=True,
    )


def _publish_run(
    cfg: DeployConfig, cfg_path: str | Path, overrides: Sequence[str], rdir: Path, err: TextIO
) -> run_record.RunRecord | None:
    """Record this run for the CLI (run_record.py); one that cannot be written is a warning."""
    record = run_record.RunRecord.of(cfg, cfg_path, overrides, rdir)
    published = _for_cli(lambda: run_record.publish(record), "the CLI will need --config", err)
    return record if published is not None else None


def _publish_stage_key(cfg_path: str | Path, stage_key: str, err: TextIO) -> Path | None:
    """Publish this run's stage key for the CLI's Control calls (none when it is '' or `off`)."""
    if not auth.stage_key({auth.STAGE_KEY_ENV: stage_key}):
        return None
    return _for_cli(
        lambda: auth.publish_stage_key(cfg_path, stage_key),
        f"the CLI will need ${auth.STAGE_KEY_ENV} for the stages' Control",
        err,
    )


def _for_cli(publish: Callable[[], Path], without: str, err: TextIO) -> Path | None:
    """`publish()` something the CLI reads; a failure is a warning (`without` says what it costs),
    not a failed start."""
    try:
        return publish()
    except (OSError, auth.SecretError) as exc:
        print(f"omnistage: warning: {without}: {exc}", file=err, flush=True)
        return None


def _install_signals(launcher: Launcher) -> dict[int, object]:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(sig: int, frame: object) -> None:
        launcher.stop_signal = sig

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    launcher.stop_signal = stop_signals.take()  # asked before this process listened (stop_signals.py)
    return previous


def _sweep_shm(err: TextIO) -> None:
    """Remove shared-memory segments left by dead processes of an earlier run.

    Safe next to starting children: a segment goes only when its owner pid is dead and no process
    holds its lock. Runs in a thread so that a slow `/dev/shm` listing never delays the start.
    """
    from omnistage.common.transport.host import sweep_stale_segments

    try:
        sweep_stale_segments()
    except Exception as exc:  # a failed sweep must not stop the start
        print(f"omnistage: warning: shm sweep failed: {exc}", file=err, flush=True)


def _start_sweep(err: TextIO) -> threading.Thread:
    thread = threading.Thread(target=_sweep_shm, args=(err,), name="shm-sweep", daemon=True)
    thread.start()
    return thread
