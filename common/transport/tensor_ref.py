"""encode/decode of `TensorRef`: a tensor travels inline, through POSIX shm, or through CUDA IPC.

Path choice (automatic unless `force`): tensors under `shm_threshold_bytes`, peers on another host and
encodes without a `TransportContext` go inline; larger tensors for a same-host peer go to the producer's
CUDA IPC pool (CUDA tensors, when enabled) or shm pool. A full pool falls back to inline after a short
bounded wait; every path taken and every fallback is counted in Prometheus (never a silent fallback).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch
from omnistage.common import metrics
from omnistage.common.log import get_logger, log_fields
from omnistage.common.transport.cuda_ipc import CudaIpcAttachments, CudaIpcPool, cuda_ipc_available
from omnistage.common.transport.dtypes import from_proto_dtype, to_proto_dtype
from omnistage.common.transport.host import SHM_DIR, TransportError, host_id
from omnistage.common.transport.shm_pool import ShmAttachments, ShmPool, clone_bytes, typed_view
from omnistage.v1 import tensor_pb2

PATHS = ("inline", "shm", "cuda_ipc")
DIRECTIONS = ("encode", "decode")
FALLBACK_REASONS = ("pool_full", "too_large", "shm_unavailable", "cuda_ipc_unavailable")

# Labelled by the process's service (metrics.set_process_service) and path / direction / reason.
TENSORS = metrics.counter("transport_tensors", "Tensors moved, by path and direction", ("path", "direction"))
BYTES = metrics.counter("transport_bytes", "Tensor bytes moved, by path and direction", ("path", "direction"))
SECONDS = metrics.histogram(
    "transport_transfer_seconds",
    "Wall time of one tensor's encode (copy into the pool or into inline bytes) or decode (map and copy "
    "out), by path and direction",
    ("path", "direction"),
    buckets=metrics.FINE_BUCKETS_S,
)
FALLBACKS = metrics.counter(
    "transport_fallbacks",
    "Tensors that wanted shared memory but went another way (pool_full, too_large, shm_unavailable, "
    "cuda_ipc_unavailable)",
    ("reason",),
)
EXPIRED = metrics.counter("transport_leases_expired", "Leases reclaimed unreleased after their TTL")


def _init_metrics(service: str) -> None:
    """Export every path, direction and reason at 0 for the process's service (a series that appears
    only at its first count hides the first increase from rate())."""
    for path in PATHS:
        for direction in DIRECTIONS:
            TENSORS.labels(service, path, direction)
            BYTES.labels(service, path, direction)
    for reason in FALLBACK_REASONS:
        FALLBACKS.labels(service, reason)
    EXPIRED.labels(service)


metrics.when_service_named(_init_metrics)

_log = get_logger(__name__)
_warned: set[str] = set()

if sys.byteorder != "little":  # inline bytes are defined as little-endian; we only run on LE hosts
    raise ImportError("omnistage tensor transport needs a little-endian host")


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


def _fallback(reason: str, nbytes: int) -> None:
    FALLBACKS.labels(metrics.process_service(), reason).inc()
    level = logging.WARNING if reason not in _warned else logging.DEBUG  # warn once per reason, then debug
    _warned.add(reason)
    log_fields(_log, level, "tensor sent inline instead of shared memory", reason=reason, bytes=nbytes)


def _choose_path(
    tensor: torch.Tensor,
    nbytes: int,
    ctx: TransportContext | None,
    force: str | None,
    peer_host_id: str | None,
) -> str:
    if force is not None:
        if force not in PATHS:
            raise ValueError(f"force must be one of {PATHS}, got {force!r}")
        if force != "inline":
            if ctx is None:
                raise TransportError(f"force={force!r} needs a TransportContext")
            if peer_host_id is not None and peer_host_id != ctx.host_id:
                raise TransportError(
                    f"force={force!r} but the peer is on host {peer_host_id}, not {ctx.host_id}"
                )
            if force == "cuda_ipc" and not tensor.is_cuda:
                raise TransportError("force='cuda_ipc' needs a CUDA tensor")
        return force
    if ctx is None or nbytes < ctx.options.shm_threshold_bytes:
        return "inline"
    if peer_host_id is not None and peer_host_id != ctx.host_id:
        return "inline"
    if tensor.is_cuda and ctx.options.enable_cuda_ipc:
        return "cuda_ipc"
    return "shm" if ctx.options.enable_shm else "inline"


def encode(
    tensor: torch.Tensor,
    *,
    transport: TransportContext | None = None,
    force: str | None = None,
    peer_host_id: str | None = None,
) -> tensor_pb2.TensorRef:
    """Describe `tensor` as a TensorRef, copying its bytes inline or into a leased shared slice.

    `peer_host_id` is the consumer's `host_id()`; None means "same host". Shared-memory refs must be
    decoded (or released) by the consumer before `lease_ttl_s`, after which the slice is reused.
    """
    started = time.perf_counter()
    nbytes = tensor.numel() * tensor.element_size()
    ref = tensor_pb2.TensorRef(
        dtype=to_proto_dtype(tensor.dtype),
        shape=list(tensor.shape),
        host_id=host_id(),
        producer_pid=os.getpid(),
    )
    path = _choose_path(tensor, nbytes, transport, force, peer_host_id)
    if path == "cuda_ipc":
        pool = transport.cuda_pool(tensor.device.index)
        cref = _put(pool, tensor, nbytes, transport, "cuda_ipc_unavailable")
        if cref is not None:
            ref.cuda.CopyFrom(cref)
            return _count(ref, "cuda_ipc", "encode", nbytes, started)
        path = "shm" if transport.options.enable_shm else "inline"
    if path == "shm":
        sref = _put(transport.shm_pool(), tensor, nbytes, transport, "shm_unavailable")
        if sref is not None:
            ref.shm.CopyFrom(sref)
            return _count(ref, "shm", "encode", nbytes, started)
    ref.inline_data = _to_bytes(tensor)
    return _count(ref, "inline", "encode", nbytes, started)


def _put(pool, tensor: torch.Tensor, nbytes: int, ctx: TransportContext, unavailable: str):
    """pool.put with fallback accounting; None when the caller must take the next path."""
    if pool is None:
        _fallback(unavailable, nbytes)
        return None
    expired_before = pool.arena.expired_total
    out = pool.put(tensor, wait_s=ctx.options.alloc_wait_s)
    EXPIRED.labels(metrics.process_service()).inc(pool.arena.expired_total - expired_before)
    if out is None:
        _fallback("too_large" if nbytes > pool.arena.capacity else "pool_full", nbytes)
    return out


def _count(
    ref: tensor_pb2.TensorRef, path: str, direction: str, nbytes: int, started: float
) -> tensor_pb2.TensorRef:
    service = metrics.process_service()
    TENSORS.labels(service, path, direction).inc()
    BYTES.labels(service, path, direction).inc(nbytes)
    SECONDS.labels(service, path, direction).observe(time.perf_counter() - started)
    return ref


def _to_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def decode(
    ref: tensor_pb2.TensorRef,
    *,
    transport: TransportContext | None = None,
    device: torch.device | str | None = None,
    copy: bool = True,
    release: bool = True,
) -> torch.Tensor:
    """The tensor a ref describes, on `device` (default: CPU for inline/shm, the ref's GPU for CUDA IPC).

    `copy=True` copies out of shared memory and releases the lease at once (with `release=False` the
    lease stays with whoever keeps it: a copy for a consumer that is not its last). `copy=False` returns a view
    into the producer's pool; the caller must `transport.release(ref)` when done, before the lease expires.
    Inline refs always give a fresh tensor.
    """
    started = time.perf_counter()
    dtype = from_proto_dtype(ref.dtype)
    shape = tuple(ref.shape)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    kind = ref.WhichOneof("payload")
    if kind is None or kind == "inline_data":
        out = _decode_inline(ref.inline_data, dtype, shape)
        out = out if device is None else out.to(device)
        _count(ref, "inline", "decode", nbytes, started)
        return out
    if transport is None:
        raise TransportError(f"a {kind} TensorRef needs a TransportContext to decode")
    sub = _mappable_slice(ref, kind, transport, f"{list(shape)} {dtype}", nbytes)
    if kind == "shm":
        u8, path = transport.shm_attachments.view(sub), "shm"
    else:
        u8, path = _cuda_view(transport, ref, device), "cuda_ipc"
    target = u8.device if device is None else torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if not copy and u8.device == target:
        _count(ref, path, "decode", nbytes, started)  # mapped, not copied: the time of the mapping
        return typed_view(u8, dtype, shape)
    try:
        if u8.device.type == "cpu" and target.type == "cpu":
            out = typed_view(clone_bytes(u8), dtype, shape)
        else:
            out = typed_view(u8, dtype, shape).to(target, copy=True)
            torch.cuda.current_stream(out.device if out.is_cuda else u8.device).synchronize()
        _check_lease(sub, kind)  # expired during the copy: the producer may have reused the bytes
    finally:
        if release:
            transport.release(ref)
    _count(ref, path, "decode", nbytes, started)
    return out


def _decode_inline(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    if len(data) != nbytes:
        raise TransportError(f"inline TensorRef {list(shape)} {dtype} needs {nbytes} bytes, got {len(data)}")
    return torch.empty(shape, dtype=dtype) if nbytes == 0 else _from_bytes(data, dtype, shape)


def _mappable_slice(
    ref: tensor_pb2.TensorRef, kind: str, transport: TransportContext, what: str, nbytes: int
) -> tensor_pb2.ShmRef | tensor_pb2.CudaIpcRef:
    """The ref's slice, once it is known to be on this host, of the tensor's size, its lease current."""
    if ref.host_id != transport.host_id:
        raise TransportError(
            f"{kind} ref from host {ref.host_id!r} cannot be mapped on host {transport.host_id!r}; "
            "the producer must encode with peer_host_id so it sends inline"
        )
    sub = ref.shm if kind == "shm" else ref.cuda
    if sub.byte_size != nbytes:
        raise TransportError(f"{kind} ref for {what} needs {nbytes} bytes, slice has {sub.byte_size}")
    _check_lease(sub, kind)
    return sub


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return typed_view(torch.frombuffer(bytearray(data), dtype=torch.uint8), dtype, shape)


def _check_lease(sub: tensor_pb2.ShmRef | tensor_pb2.CudaIpcRef, kind: str) -> None:
    if sub.lease_expiry_unix_ms and time.time() * 1000 > sub.lease_expiry_unix_ms:
        raise TransportError(
            f"{kind} lease {sub.lease_id} expired at {sub.lease_expiry_unix_ms} ms; the slice may have been reused"
        )


def _cuda_view(
    ctx: TransportContext, ref: tensor_pb2.TensorRef, device: torch.device | str | None
) -> torch.Tensor:
    dev = torch.device(device) if device is not None else None
    on_gpu = dev is not None and dev.type == "cuda" and dev.index is not None
    return ctx.cuda_attachments.view(ref.cuda, dev.index if on_gpu else ref.cuda.device_index)
