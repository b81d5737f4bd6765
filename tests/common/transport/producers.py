"""Producer processes for the transport tests: a segment owner that dies or lives on command, or a
stage that encodes tensors from two threads.

Each is forked from one multiprocessing fork server that imported the transport modules once: a
fresh interpreter per producer imported torch again (~4 CPU s each).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from multiprocessing.connection import Connection

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["omnistage.common.transport.tensor_ref"])
ENCODED = 64 << 10  # float32 elements of each encoded tensor (256 KiB)


def encoded(tag: int):
    """The tensor a `tensors` producer encodes for `tag`."""
    import torch

    return torch.arange(ENCODED, dtype=torch.float32) + tag


def _pool(conn: Connection, shm_dir: str | None = None) -> None:
    """A producer's ShmPool: its name sent, then closed (unlinked by its owner) when told to."""
    from omnistage.common.transport.shm_pool import ShmPool

    pool = ShmPool(1 << 16) if shm_dir is None else ShmPool(1 << 16, shm_dir=shm_dir)
    conn.send(pool.name)
    conn.recv()
    pool.close()
    conn.send("closed")


def _lease_table(conn: Connection, shm_dir: str | None = None) -> None:
    """A CUDA IPC producer's lease-table segment: its name sent, then it dies without cleaning up
    when told to."""
    from omnistage.common.transport.host import Segment
    from omnistage.common.transport.shm_pool import LeaseTable, table_bytes

    seg = Segment.create(table_bytes(16), shm_dir=shm_dir) if shm_dir else Segment.create(table_bytes(16))
    LeaseTable.format(seg, 16, 0)
    conn.send(seg.name)
    conn.recv()
    os._exit(0)


def _tensors(conn: Connection, proc_tag: int, per_thread: int) -> None:
    """Two threads encode `per_thread` tensors each through one small pool, sending (tag, ref bytes);
    then "done", and the pool is kept until told to close it."""
    from omnistage.common.transport import TransportContext, TransportOptions, encode

    opts = TransportOptions(shm_pool_bytes=1 << 20, shm_threshold_bytes=1024, alloc_wait_s=0.5, max_leases=16)
    ctx = TransportContext(opts)
    out = threading.Lock()

    def run(thread: int) -> None:
        for i in range(per_thread):
            tag = proc_tag * 10000 + thread * 1000 + i
            ref = encode(encoded(tag), transport=ctx)
            with out:
                conn.send((tag, ref.SerializeToString()))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.send("done")
    conn.recv()  # keep the pool until the consumer has read every slice
    ctx.close()


class Producer:
    """A forked producer: `name` is its segment, `pid` its owner pid."""

    KINDS = {"pool": _pool, "lease_table": _lease_table, "tensors": _tensors}

    def __init__(self, kind: str, *args: object) -> None:
        self._conn, child = _CONTEXT.Pipe()
        self.proc = _CONTEXT.Process(target=self.KINDS[kind], args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.pid: int = self.proc.pid
        self.name = ""
        if kind != "tensors":
            self.name = self.said(120)
            if not self.name:
                raise RuntimeError(f"producer pid {self.pid} sent no segment name within 120 s")

    def tell(self) -> None:
        """Go on: a pool closes and says so, a lease-table producer dies, a tensors producer closes its
        pool and exits (nothing, for a producer already gone)."""
        with contextlib.suppress(OSError):
            self._conn.send("go")

    def said(self, timeout_s: float = 60):
        """The next message, or "" when none came within `timeout_s` (or the producer is gone)."""
        try:
            return self._conn.recv() if self._conn.poll(timeout_s) else ""
        except EOFError:
            return ""

    def wait(self, timeout_s: float = 60) -> int | None:
        self.proc.join(timeout_s)
        return self.proc.exitcode

    def stop(self) -> None:
        """Clean-up: kill it if it still runs."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(60)
        self._conn.close()
