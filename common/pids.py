"""Whether a process is alive, apart from the transport package (which imports torch) so that the
launcher and the CLI, which only watch processes, never import torch (seconds of CPU per `serve`)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if `pid` names a running (not zombie) process visible from here."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True
