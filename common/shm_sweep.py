"""Removing the `/dev/shm` segments of dead processes, apart from the transport package (which imports
torch) so that the launcher sweeps before and after its children without importing torch."""

from __future__ import annotations

import fcntl
import os

from omnistage.common.pids import pid_alive
from omnistage.common.shm_names import SHM_DIR, segment_owner_pid


def sweep_stale_segments(shm_dir: str = SHM_DIR, owners: set[int] | None = None) -> list[str]:
    """Remove `omnistage-<pid>-*` segments whose owner is dead (of `owners` only, when given); return
    the names removed.

    A segment is removed only if its pid is not alive here *and* no process holds its flock, so a
    live process's segment is never touched (also when its pid lives in another PID namespace).
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        pid = segment_owner_pid(name)
        if pid is None or pid == os.getpid() or (owners is not None and pid not in owners) or pid_alive(pid):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue  # locked by a live owner, or not ours to remove
        finally:
            os.close(fd)
    return removed
