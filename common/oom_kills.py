"""How many processes the kernel's OOM killer has ended: to tell "killed by SIGKILL" from "out of memory".

A SIGKILL may come from anyone; only a rise of this count while a process lived says the OOM killer
ended it. Read from this process's memory cgroup (v2 `memory.events`, v1 `memory.oom_control`: the
kills of the container, whoever's OOM it was), else from `/proc/vmstat` (the whole host).
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
VMSTAT = Path("/proc/vmstat")


def _memory_cgroup(proc_cgroup: str) -> Path | None:
    """The memory cgroup directory named in /proc/self/cgroup (v2 `0::/x`, or v1 `N:memory:/x`)."""
    for line in proc_cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            return CGROUP_ROOT / "memory" / path.lstrip("/")
        if hid == "0" and controllers == "":
            return CGROUP_ROOT / path.lstrip("/")
    return None


def _counter(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def oom_kill_count() -> int | None:
    """The OOM killer's count of kills (this cgroup's when readable, else the host's); None when
    this system tells none."""
    try:
        group = _memory_cgroup(PROC_CGROUP.read_text())
    except OSError:
        group = None
    if group is not None:
        for name in ("memory.events", "memory.oom_control"):
            count = _counter(group / name, "oom_kill")
            if count is not None:
                return count
    return _counter(VMSTAT, "oom_kill")


def oom_killed_since(count_before: int | None) -> bool:
    """Whether the OOM killer ended a process since `oom_kill_count()` said `count_before`."""
    if count_before is None:
        return False
    now = oom_kill_count()
    return now is not None and now > count_before
