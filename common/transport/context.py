"""A process's transport state: its producer pools (shm, CUDA IPC per device) and the mappings of other
processes' pools it consumes from.

Importing it, building a context, releasing a lease and closing need no torch: the gateway, which only
releases the leases of refs it drops, starts without the seconds of CPU that torch costs; torch loads
where a tensor is copied into a pool or viewed out of one.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass

from omnistage.common import metrics
from omnistage.common.log import get_logger, log_fields
from omnistage.common.transport.cuda_ipc import CudaIpcAttachments, CudaIpcPool, cuda_ipc_available
from omnistage.common.transport.host import SHM_DIR, host_id
from omnistage.common.transport.shm_pool import ShmAttachments, ShmPool
from omnistage.common.transport.transfer_metrics import EXPIRED
from omnistage.v1 import tensor_pb2

_log = get_logger(__name__)


@dataclass(frozen=True)
class TransportOptions:
    """Per-process transport settings; pools are created lazily at first use."""

    shm_threshold_bytes: int = 64 * 1024
    shm_pool_bytes: int = 256 << 20
    cuda_pool_bytes: int = 256 << 20
    lease_ttl_s: float = 60.0
    alloc_wait_s: float = 0.05
    max_leases: int = 4096
    enable_shm: bool = True
    enable_cuda_ipc: bool = True
    reserve_shm: bool = True
    shm_dir: str = SHM_DIR


class TransportContext:
    """Per-process state: producer pools (shm, CUDA per device) and consumer-side mapping caches.

    Thread-safe. Close it (or let atexit) to unlink the pools; a forked child gets pools of its own.
    """

    def __init__(self, options: TransportOptions | None = None):
        self.options = options or TransportOptions()
        self.host_id = host_id()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._shm_pool: ShmPool | None = None
        self._shm_disabled = False
        self._cuda_pools: dict[int, CudaIpcPool] = {}
        self.shm_attachments = ShmAttachments(self.options.shm_dir)
        self.cuda_attachments = CudaIpcAttachments(self.options.shm_dir)
        atexit.register(self.close)

    def shm_pool(self) -> ShmPool | None:
        """This process's shm pool (created on first use), or None if shm is off or cannot be created."""
        with self._lock:
            self._forget_parent_pools_locked()
            if self._shm_pool is None and self.options.enable_shm and not self._shm_disabled:
                o = self.options
                try:
                    self._shm_pool = ShmPool(
                        o.shm_pool_bytes,
                        lease_ttl_s=o.lease_ttl_s,
                        max_leases=o.max_leases,
                        reserve=o.reserve_shm,
                        shm_dir=o.shm_dir,
                    )
                except OSError as e:
                    self._shm_disabled = True
                    log_fields(
                        _log,
                        logging.WARNING,
                        "shm pool unavailable, sending inline",
                        error=str(e),
                        dir=o.shm_dir,
                    )
            return self._shm_pool

    def cuda_pool(self, device: int) -> CudaIpcPool | None:
        """This process's CUDA IPC pool on `device`, or None if CUDA IPC is off or unavailable."""
        if not (self.options.enable_cuda_ipc and cuda_ipc_available()):
            return None
        with self._lock:
            self._forget_parent_pools_locked()
            pool = self._cuda_pools.get(device)
            if pool is None:
                o = self.options
                pool = CudaIpcPool(
                    device,
                    o.cuda_pool_bytes,
                    lease_ttl_s=o.lease_ttl_s,
                    max_leases=o.max_leases,
                    shm_dir=o.shm_dir,
                )
                self._cuda_pools[device] = pool
            return pool

    def release(self, ref: tensor_pb2.TensorRef) -> None:
        """Give back the slice behind a ref decoded with `copy=False` (no-op for inline refs)."""
        kind = ref.WhichOneof("payload")
        if kind == "shm":
            self.shm_attachments.release(ref.shm)
        elif kind == "cuda":
            self.cuda_attachments.release(ref.cuda)

    def revoke(self, ref: tensor_pb2.TensorRef) -> bool:
        """Producer side: free the slice of a ref this process encoded but never handed out (the send
        failed or was aborted). False for inline refs, other processes' refs and inactive leases."""
        kind = ref.WhichOneof("payload")
        with self._lock:
            if kind == "shm" and self._shm_pool is not None and ref.shm.pool_name == self._shm_pool.name:
                return self._shm_pool.arena.release(ref.shm.lease_id)
            pool = self._cuda_pools.get(ref.cuda.device_index) if kind == "cuda" else None
        if pool is not None and pool.pool_id == ref.cuda.pool_id:
            return pool.arena.release(ref.cuda.lease_id)
        return False

    def reclaim_expired(self) -> int:
        """Reclaim released and expired slices of this process's pools now (allocation does it too)."""
        pools = [p for p in [self._shm_pool, *self._cuda_pools.values()] if p is not None]
        before = sum(p.arena.expired_total for p in pools)
        n = sum(p.arena.reclaim() for p in pools)
        EXPIRED.labels(metrics.process_service()).inc(sum(p.arena.expired_total for p in pools) - before)
        return n

    def _forget_parent_pools_locked(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's pools are not ours to use or unlink
            self._pid, self._shm_pool, self._cuda_pools = os.getpid(), None, {}

    def close(self) -> None:
        """Unlink this process's pools and drop consumer mappings; idempotent."""
        with self._lock:
            self._forget_parent_pools_locked()
            pools = [p for p in [self._shm_pool, *self._cuda_pools.values()] if p is not None]
            self._shm_pool, self._cuda_pools = None, {}
        for pool in pools:
            pool.close()
        self.shm_attachments.close()
        self.cuda_attachments.close()

    def __enter__(self) -> TransportContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
