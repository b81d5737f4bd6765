"""encode/decode of `TensorRef`: a tensor travels inline, through POSIX shm, or through CUDA IPC.

Path choice (automatic unless `force`): tensors under `shm_threshold_bytes`, peers on another host and
encodes without a `TransportContext` go inline; larger tensors for a same-host peer go to the producer's
CUDA IPC pool (CUDA tensors, when enabled) or shm pool. A full pool falls back to inline after a short
bounded wait; every path taken and every fallback is counted in Prometheus (never a silent fallback).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import TYPE_CHECKING

import torch
from omnistage.common import metrics
from omnistage.common.log import get_logger, log_fields
from omnistage.common.transport.dtypes import from_proto_dtype, to_proto_dtype
from omnistage.common.transport.host import TransportError, host_id
from omnistage.common.transport.shm_pool import clone_bytes, typed_view
from omnistage.common.transport.transfer_metrics import BYTES, EXPIRED, FALLBACKS, PATHS, SECONDS, TENSORS
from omnistage.v1 import tensor_pb2

if TYPE_CHECKING:
    from omnistage.common.transport.context import TransportContext

_log = get_logger(__name__)
_warned: set[str] = set()

if sys.byteorder != "little":  # inline bytes are defined as little-endian; we only run on LE hosts
    raise ImportError("omnistage tensor transport needs a little-endian host")


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
