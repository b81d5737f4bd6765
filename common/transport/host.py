"""What the transport knows about this host: its identity, process liveness and `/dev/shm` segments.

Shared memory is only valid between processes of one host, so every ref carries `host_id()`; segments
are files in `/dev/shm` owned by one process, which holds an exclusive `flock` on them for its life so
that a sweeper can tell a dead owner from a live one even across PID namespaces.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import socket
from functools import cache

from omnistage.common.pids import pid_alive
from omnistage.common.shm_names import SEGMENT_PREFIX, SHM_DIR, segment_owner_pid
from omnistage.common.shm_sweep import sweep_stale_segments

__all__ = [
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "Segment",
    "TransportError",
    "host_id",
    "pid_alive",
    "segment_owner_pid",
    "sweep_stale_segments",
]


class TransportError(RuntimeError):
    """A tensor could not be encoded or decoded; the message names the ref, pool or peer involved."""


@cache
def host_id() -> str:
    """`<hostname>:<boot id>`: equal only for processes that can share this host's `/dev/shm`.

    `OMNISTAGE_HOST_ID` overrides it (e.g. containers started with `--ipc=host` on one machine).
    """
    override = os.environ.get("OMNISTAGE_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}:{boot}"


class Segment:
    """A named `/dev/shm` file mapped read-write. The owner created it (0600) and alone unlinks it."""

    def __init__(self, name: str, byte_size: int, fd: int | None, mm: mmap.mmap, owner: bool, shm_dir: str):
        self.name = name
        self.byte_size = byte_size
        self.owner = owner
        self.owner_pid = os.getpid() if owner else segment_owner_pid(name)
        self.mm = mm
        self._fd = fd  # kept open by the owner: its flock marks the segment as live
        self._path = os.path.join(shm_dir, name)

    @classmethod
    def create(cls, byte_size: int, *, shm_dir: str = SHM_DIR, reserve: bool = True) -> Segment:
        """Create `omnistage-<pid>-<token>`; `reserve` commits the pages now (ENOSPC here, not SIGBUS later)."""
        name = f"{SEGMENT_PREFIX}-{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(shm_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, byte_size)
            if reserve:
                os.posix_fallocate(fd, 0, byte_size)
            mm = mmap.mmap(fd, byte_size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(name, byte_size, fd, mm, True, shm_dir)

    @classmethod
    def attach(cls, name: str, byte_size: int | None, *, shm_dir: str = SHM_DIR) -> Segment:
        """Map another process's segment (`byte_size` None: as large as the file); never unlinks it."""
        if segment_owner_pid(name) is None:
            raise TransportError(f"refusing to map {name!r}: not an omnistage segment name")
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise TransportError(f"shm segment {path} is gone (producer exited?)") from None
        try:
            actual = os.fstat(fd).st_size
            byte_size = actual if byte_size is None else byte_size
            if actual != byte_size or actual == 0:
                raise TransportError(f"shm segment {path} has {actual} bytes, ref says {byte_size}")
            mm = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)
        return cls(name, byte_size, None, mm, False, shm_dir)

    def close(self) -> None:
        """Unlink (owner, in the creating process only) and unmap once no tensor views remain."""
        if self.owner and self.owner_pid == os.getpid():
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
        try:
            self.mm.close()
        except BufferError:
            pass  # zero-copy views still use the mapping; it is unmapped when the last one dies
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
