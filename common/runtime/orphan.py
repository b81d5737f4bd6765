"""A service process never outlives its launcher, nor leaves its shared memory behind when it goes."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time

from omnistage.common.shm_names import SHM_DIR, segment_owner_pid

LAUNCHER_PID_ENV = "OMNISTAGE_LAUNCHER_PID"
# How long an orphan's graceful stop (SIGTERM) may take before the process exits hard.
ORPHAN_EXIT_S = 3.0
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.25

_log = logging.getLogger(__name__)
_launcher_pid: int | None = None  # the launcher this process belongs to, once die_with_launcher ran
_parent: int | None = None  # the process watch_parent watches


def die_with_launcher() -> int | None:
    """Tie this process to the launcher named by $OMNISTAGE_LAUNCHER_PID (no-op without it); the pid.

    The variable is taken out of the environment, so that helpers this process starts (compile
    workers) are not mistaken for services of their own."""
    global _launcher_pid
    if _launcher_pid is not None:
        return _launcher_pid
    value = os.environ.pop(LAUNCHER_PID_ENV, "")
    if not value:
        return None
    _launcher_pid = int(value)
    if sys.platform.startswith("linux"):
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, lambda sig, frame: _orphaned_now())
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGHUP), 0, 0, 0)
    if os.getppid() != _launcher_pid:  # the launcher died before prctl took effect
        print(f"omnistage: launcher pid {_launcher_pid} is gone, exiting", file=sys.stderr, flush=True)
        os._exit(1)
    return _launcher_pid


def watch_parent(exit_after_s: float = ORPHAN_EXIT_S) -> None:
    """Start the watchdog (once): when the launcher is gone, unlink our segments, stop, exit hard
    `exit_after_s` later. Without a launcher (a service run by hand) it watches the parent process."""
    global _parent
    if _parent is not None:
        return
    parent = _parent = die_with_launcher() or os.getppid()
    threading.Thread(
        target=_watchdog, args=(parent, exit_after_s), name="parent-watchdog", daemon=True
    ).start()


def _wait_gone(pid: int) -> None:
    """Return once `pid` is no longer our parent (a pidfd wakes at once; else polling)."""
    fd = None
    with contextlib.suppress(OSError, AttributeError):
        fd = os.pidfd_open(pid)
    try:
        while os.getppid() == pid:
            if fd is not None:
                select.select([fd], [], [], _POLL_S * 4)
            else:
                time.sleep(_POLL_S)
    finally:
        if fd is not None:
            os.close(fd)


_stopping = threading.Lock()


def _orphaned_now() -> None:
    """The launcher is gone: unlink our segments, then (the first time only) SIGTERM ourselves."""
    remove_own_segments()
    if _stopping.acquire(blocking=False):
        _log.warning("launcher pid %s is gone, stopping", _launcher_pid or _parent)
        os.kill(os.getpid(), signal.SIGTERM)


def _watchdog(parent: int, exit_after_s: float) -> None:
    _wait_gone(parent)
    _orphaned_now()
    time.sleep(exit_after_s)
    remove_own_segments()  # a pool made during the stop
    os._exit(1)


def orphaned() -> bool:
    """True when the launcher (or the watched parent) is gone."""
    return _parent is not None and os.getppid() != _parent


def before_exit() -> None:
    """The last thing a service process does: an orphan unlinks its segments (made after the handler ran)."""
    if orphaned() or _stopping.locked():
        remove_own_segments()


def remove_own_segments() -> list[str]:
    """Unlink this process's `/dev/shm` segments (`omnistage-<pid>-*`); the names removed."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            if segment_owner_pid(name) == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, name))
                    removed.append(name)
    return removed
