"""CUDA MPS for stages that share a GPU: one control daemon per `serve`, owned by the launcher."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from omnistage.common.config import DeployConfig, MpsConfig

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
PRIORITIES = {"normal": "0", "below_normal": "1"}
# A unix socket's path has room for 107 bytes: a longer run dir puts the pipe under a short temp dir.
_MAX_PIPE_DIR = 80
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1


class MpsError(RuntimeError):
    """The daemon did not start (or answer) as it must; the message says what it did."""


def shared_gpus(cfg: DeployConfig) -> dict[int, list[str]]:
    """GPU index → the stage processes (`name rank`) on it, for the GPUs that host more than one."""
    on: dict[int, list[str]] = {}
    for svc in cfg.services.values():
        if svc.device != "cuda":
            continue
        for rank in range(svc.tp_size):
            on.setdefault(svc.gpu_of(rank), []).append(f"{svc.name} r{rank}")
    count = Counter({gpu: len(names) for gpu, names in on.items()})
    return {gpu: on[gpu] for gpu in sorted(on) if count[gpu] > 1}


def wanted(cfg: DeployConfig) -> bool:
    """Whether this deployment asks for a daemon: `on` with any CUDA stage, `auto` with a shared GPU."""
    mode = cfg.devices.mps.mode
    if mode == "off":
        return False
    if mode == "on":
        return any(s.device == "cuda" for s in cfg.services.values())
    return bool(shared_gpus(cfg))


def _die_with_parent() -> Callable[[], None]:
    """A preexec_fn that asks the kernel for SIGTERM when the launcher dies (libc resolved before the
    fork: the child only calls into C)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return set_pdeathsig


class MpsDaemon:
    """One control daemon in the foreground, a child of the launcher. `start()`, `env()`, `stop()`."""

    def __init__(self, cfg: MpsConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.log_dir = run_dir / "mps" / "log"
        self.pipe_dir = run_dir / "mps" / "pipe"
        self._own_root: Path | None = None
        if len(str(self.pipe_dir / "control")) > _MAX_PIPE_DIR:
            self._own_root = Path(tempfile.mkdtemp(prefix="omnistage-mps-"))
            self.pipe_dir = self._own_root / "pipe"
        self.proc: subprocess.Popen | None = None

    def _daemon_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (THREAD_PERCENTAGE_ENV, PRIORITY_ENV)}
        return env | {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def env(self, thread_percentage: int = 0, priority: str = "normal") -> dict[str, str]:
        """What a stage process needs to be this daemon's client (its SM share and priority)."""
        out = {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir), PRIORITY_ENV: PRIORITIES[priority]}
        if thread_percentage:
            out[THREAD_PERCENTAGE_ENV] = str(thread_percentage)
        return out

    def start(self) -> None:
        """Start the daemon and wait (at most `start_timeout_s`) for its control pipe; MpsError if it
        cannot be found, exits or does not open the pipe in time (nothing is left running then)."""
        binary = shutil.which(self.cfg.control_binary)
        if binary is None:
            raise MpsError(f"{self.cfg.control_binary!r} not found on PATH (the NVIDIA driver's utilities)")
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / "launcher-daemon.log", "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "-f"],
                env=self._daemon_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not (self.pipe_dir / "control").exists():
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                self._remove_own_root()
                raise MpsError(f"the control daemon exited with code {code}: {self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise MpsError(
                    f"no control pipe in {self.pipe_dir} after {self.cfg.start_timeout_s:g}s "
                    f"(devices.mps.start_timeout_s): {self._log_tail()}"
                )
            time.sleep(_POLL_S)

    def stop(self) -> str:
        """`quit` to the daemon, its exit within `stop_timeout_s`, else SIGKILL; '' or what went wrong."""
        proc, self.proc = self.proc, None
        if proc is None:
            return ""
        problem = ""
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        try:
            subprocess.run(
                [proc.args[0]],
                input=b"quit\n",
                env=self._daemon_env(),
                capture_output=True,
                timeout=self.cfg.stop_timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            problem = f"quit was not taken ({exc})"
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5.0)
            problem = problem or f"it did not quit within {self.cfg.stop_timeout_s:g}s: killed"
        self._remove_own_root()
        return problem

    def _log_tail(self, lines: int = 5) -> str:
        texts = []
        for path in sorted(self.log_dir.glob("*.log")):
            with contextlib.suppress(OSError):
                texts += path.read_text(errors="replace").strip().splitlines()
        return " | ".join(texts[-lines:]) or "no log"

    def _remove_own_root(self) -> None:
        if self._own_root is not None:
            shutil.rmtree(self._own_root, ignore_errors=True)
