"""Producer processes for the shared-memory tests: a segment owner that dies or lives on command.

Each is forked from one multiprocessing fork server that imported the pool module once: a fresh
interpreter per producer imported torch again (~4 CPU s each) only to create a segment.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["omnistage.common.transport.shm_pool"])


def _pool(conn: Connection, shm_dir: str | None) -> None:
    """A producer's ShmPool: its name sent, then closed (unlinked by its owner) when told to."""
    from omnistage.common.transport.shm_pool import ShmPool

    pool = ShmPool(1 << 16) if shm_dir is None else ShmPool(1 << 16, shm_dir=shm_dir)
    conn.send(pool.name)
    conn.recv()
    pool.close()
    conn.send("closed")


def _lease_table(conn: Connection, shm_dir: str | None) -> None:
    """A CUDA IPC producer's lease-table segment: its name sent, then it dies without cleaning up
    when told to."""
    from omnistage.common.transport.host import Segment
    from omnistage.common.transport.shm_pool import LeaseTable, table_bytes

    seg = Segment.create(table_bytes(16), shm_dir=shm_dir) if shm_dir else Segment.create(table_bytes(16))
    LeaseTable.format(seg, 16, 0)
    conn.send(seg.name)
    conn.recv()
    os._exit(0)


class Producer:
    """A forked producer: `name` is its segment, `pid` its owner pid."""

    KINDS = {"pool": _pool, "lease_table": _lease_table}

    def __init__(self, kind: str, shm_dir: str | None = None) -> None:
        self._conn, child = _CONTEXT.Pipe()
        self.proc = _CONTEXT.Process(target=self.KINDS[kind], args=(child, shm_dir), daemon=True)
        self.proc.start()
        child.close()
        if not self._conn.poll(120):
            raise TimeoutError(f"producer pid {self.proc.pid} sent no segment name in 120 s")
        self.name: str = self._conn.recv()
        self.pid: int = self.proc.pid

    def tell(self) -> None:
        """Go on: a pool closes and says so, a lease-table producer dies."""
        self._conn.send("go")

    def said(self) -> str:
        return self._conn.recv() if self._conn.poll(60) else ""

    def wait(self, timeout_s: float = 60) -> int | None:
        self.proc.join(timeout_s)
        return self.proc.exitcode

    def stop(self) -> None:
        """Clean-up: kill it if it still runs."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(60)
        self._conn.close()
