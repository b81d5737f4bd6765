"""CUDA IPC pool: one cudaMalloc'ed buffer per device, exported once; consumers open it once and cache it.

torch loads where device memory is allocated, wrapped or synchronized: releasing a lease (a store into
the pool's shared lease table) needs none, so a process that only releases (the gateway) never imports it.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from omnistage.common.transport.host import SHM_DIR, Segment, TransportError, pid_alive, segment_owner_pid
from omnistage.common.transport.shm_pool import Lease, LeasedPool, LeaseTable, table_bytes, typed_view
from omnistage.v1 import tensor_pb2

if TYPE_CHECKING:
    import torch

_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


def _find_cudart(cuda_version: str | None) -> str:
    """Path of the libcudart torch already loaded (same instance, same device state), else the soname of
    torch's CUDA version."""
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcudart.so" in line:
                return line.split(maxsplit=5)[-1].strip()
    major = (cuda_version or "12").split(".")[0]
    return f"libcudart.so.{major}"


class _CudaRuntime:
    """The few libcudart calls torch does not expose: malloc/free and IPC handles."""

    def __init__(self, path: str) -> None:
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise TransportError(f"CUDA IPC unavailable: cannot load {path}: {e}") from None
        vp, vpp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        sigs = {
            "cudaGetDevice": [ctypes.POINTER(ctypes.c_int)],
            "cudaSetDevice": [ctypes.c_int],
            "cudaMalloc": [vpp, ctypes.c_size_t],
            "cudaFree": [vp],
            "cudaIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), vp],
            "cudaIpcOpenMemHandle": [vpp, _IpcHandle, ctypes.c_uint],
            "cudaIpcCloseMemHandle": [vp],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
        self.lib = lib

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            msg = self.lib.cudaGetErrorString(err).decode()
            raise TransportError(f"{what} failed: {msg} (cudaError {err})")

    @contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        prev = ctypes.c_int()
        self._check(self.lib.cudaGetDevice(ctypes.byref(prev)), "cudaGetDevice")
        self._check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
        try:
            yield
        finally:
            self.lib.cudaSetDevice(prev.value)

    def malloc(self, device: int, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        with self.on_device(device):
            self._check(
                self.lib.cudaMalloc(ctypes.byref(ptr), nbytes), f"cudaMalloc({nbytes}) on cuda:{device}"
            )
        return ptr.value

    def free(self, device: int, ptr: int) -> None:
        with self.on_device(device):
            self._check(self.lib.cudaFree(ctypes.c_void_p(ptr)), f"cudaFree on cuda:{device}")

    def export(self, device: int, ptr: int) -> bytes:
        handle = _IpcHandle()
        with self.on_device(device):
            self._check(
                self.lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)),
                "cudaIpcGetMemHandle",
            )
        return ctypes.string_at(ctypes.addressof(handle), _HANDLE_BYTES)

    def open(self, device: int, raw: bytes) -> int:
        if len(raw) != _HANDLE_BYTES:
            raise TransportError(f"CUDA IPC handle must be {_HANDLE_BYTES} bytes, got {len(raw)}")
        handle = _IpcHandle.from_buffer_copy(raw)
        ptr = ctypes.c_void_p()
        with self.on_device(device):
            err = self.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), handle, _LAZY_ENABLE_PEER_ACCESS)
            self._check(err, f"cudaIpcOpenMemHandle on cuda:{device}")
        return ptr.value

    def close(self, device: int, ptr: int) -> None:
        with self.on_device(device):
            self._check(self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


@cache
def cuda_runtime() -> _CudaRuntime:
    import torch

    if not torch.cuda.is_available():
        raise TransportError("CUDA IPC unavailable: no CUDA device")
    torch.cuda.init()
    return _CudaRuntime(_find_cudart(torch.version.cuda))


_LOCAL_POOLS: weakref.WeakValueDictionary[str, CudaIpcPool] = weakref.WeakValueDictionary()


def local_pool(pool_id: str) -> CudaIpcPool | None:
    """This process's live pool `pool_id`: cudaIpcOpenMemHandle refuses handles exported by the caller."""
    return _LOCAL_POOLS.get(pool_id)


def cuda_ipc_available() -> bool:
    """True if this process can export and open CUDA IPC handles."""
    try:
        cuda_runtime()
    except TransportError:
        return False
    return True


class _DeviceMemory:
    """`__cuda_array_interface__` over raw device memory, so torch can view it without copying."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def _wrap(ptr: int, nbytes: int, device: int) -> tuple[torch.Tensor, weakref.ref]:
    """A uint8 tensor over raw device memory, and a weak reference to the object that owns the memory
    view: torch keeps that object alive while any tensor viewing it lives, so a dead reference means
    no view of the memory is left (the handle may then be closed)."""
    import torch

    holder = _DeviceMemory(ptr, nbytes)
    return torch.as_tensor(holder, device=torch.device("cuda", device)), weakref.ref(holder)


class CudaIpcPool(LeasedPool):
    """Producer side, one per device: `put` copies a CUDA tensor into a leased slice of the exported buffer."""

    def __init__(
        self,
        device: int,
        byte_size: int,
        *,
        lease_ttl_s: float = 60.0,
        max_leases: int = 4096,
        alignment: int = 256,
        shm_dir: str = SHM_DIR,
    ):
        rt = cuda_runtime()
        self.device = device
        self.byte_size = byte_size
        self._ptr = rt.malloc(device, byte_size)
        try:
            self.handle = rt.export(device, self._ptr)
            self.buffer, _ = _wrap(self._ptr, byte_size, device)
            segment = Segment.create(table_bytes(max_leases), shm_dir=shm_dir)
        except BaseException:
            rt.free(device, self._ptr)
            raise
        super().__init__(
            segment,
            max_leases,
            byte_size,
            data_in_segment=False,
            lease_ttl_s=lease_ttl_s,
            alignment=alignment,
        )
        _LOCAL_POOLS[self.pool_id] = self

    @property
    def pool_id(self) -> str:
        return self.segment.name

    def put(self, tensor: torch.Tensor, *, wait_s: float = 0.0) -> tensor_pb2.CudaIpcRef | None:
        """Copy `tensor` into a slice and wait for the copy, so the consumer may read at once."""
        import torch

        nbytes = tensor.numel() * tensor.element_size()

        def copy(lease: Lease) -> None:
            dst = typed_view(
                self.buffer[lease.offset : lease.offset + nbytes], tensor.dtype, tuple(tensor.shape)
            )
            with torch.cuda.device(self.device):
                dst.copy_(tensor)
                torch.cuda.current_stream(self.device).synchronize()

        lease = self.arena.fill(nbytes, copy, wait_s=wait_s)
        if lease is None:
            return None
        return tensor_pb2.CudaIpcRef(
            pool_id=self.pool_id,
            ipc_handle=self.handle,
            device_index=self.device,
            pool_byte_size=self.byte_size,
            offset=lease.offset,
            **self.lease_fields(lease, nbytes),
        )

    def _close_data(self) -> None:
        """The device buffer: no copy in flight, no view of ours left, then freed (consumers' mappings
        keep the memory until they close their handles)."""
        import torch

        _LOCAL_POOLS.pop(self.pool_id, None)
        torch.cuda.synchronize(self.device)
        self.buffer = None
        cuda_runtime().free(self.device, self._ptr)


@dataclass
class _Opened:
    """One producer pool opened on one device: the mapped pointer and our view of it."""

    ptr: int
    buffer: torch.Tensor | None
    # Alive while any tensor viewing the mapping lives (ours or a consumer's).
    holder: weakref.ref


class CudaIpcAttachments:
    """Consumer side: each (pool, device) opened once and cached; releases go to the pool's lease table.

    A handle opened from a producer that has died pins that producer's GPU memory for as long as it
    stays open, so handles of dead producers are closed (`prune_dead`, also run when a new pool is
    opened and at most every `prune_interval_s` on `view`) once no tensor viewing them is left.
    """

    def __init__(self, shm_dir: str = SHM_DIR, prune_interval_s: float = 5.0):
        self._shm_dir = shm_dir
        self._lock = threading.Lock()
        self._opened: dict[tuple[str, int], _Opened] = {}
        self._tables: dict[str, LeaseTable] = {}
        self._prune_interval_s = prune_interval_s
        self._last_prune = time.monotonic()

    def view(self, ref: tensor_pb2.CudaIpcRef, device: int) -> torch.Tensor:
        """Zero-copy uint8 view of the slice, opened on `device` (the consumer's own GPU)."""
        if ref.offset + ref.byte_size > ref.pool_byte_size:
            raise TransportError(f"CUDA IPC ref [{ref.offset}, +{ref.byte_size}) outside pool {ref.pool_id}")
        pool = local_pool(ref.pool_id)
        if pool is not None:  # produced by this very process
            return pool.buffer[ref.offset : ref.offset + ref.byte_size]
        with self._lock:
            key = (ref.pool_id, device)
            opened = self._opened.get(key)
            if opened is None or time.monotonic() - self._last_prune >= self._prune_interval_s:
                self._prune_dead_locked(keep=key)
            if opened is None:
                self._table_locked(ref.pool_id)
                ptr = cuda_runtime().open(device, ref.ipc_handle)
                buffer, holder = _wrap(ptr, ref.pool_byte_size, device)
                opened = self._opened[key] = _Opened(ptr, buffer, holder)
            buffer = opened.buffer
        return buffer[ref.offset : ref.offset + ref.byte_size]

    def release(self, ref: tensor_pb2.CudaIpcRef) -> None:
        pool = local_pool(ref.pool_id)
        if pool is not None:
            pool.table.release(ref.lease_id)
            return
        with self._lock:
            table = self._table_locked(ref.pool_id)
        table.release(ref.lease_id)

    def prune_dead(self) -> int:
        """Close the handles of producers that are gone and no longer viewed; returns how many closed."""
        with self._lock:
            return self._prune_dead_locked()

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._opened)

    def _prune_dead_locked(self, keep: tuple[str, int] | None = None) -> int:
        self._last_prune = time.monotonic()
        dead = [k for k in self._opened if k != keep and not pid_alive(self._owner_pid(k[0]))]
        if not dead:
            return 0
        for key in dead:
            self._opened[key].buffer = None  # drop our own view; consumers' views keep the holder alive
        gc.collect()
        closed = 0
        for key in dead:
            opened = self._opened[key]
            if opened.holder() is not None:
                continue  # a consumer still reads it: closed on a later prune
            cuda_runtime().close(key[1], opened.ptr)
            del self._opened[key]
            closed += 1
            if not any(k[0] == key[0] for k in self._opened):
                table = self._tables.pop(key[0], None)
                if table is not None:
                    table.close()
                    table.segment.close()
        return closed

    def _owner_pid(self, pool_id: str) -> int:
        table = self._tables.get(pool_id)
        return (table.segment.owner_pid if table is not None else segment_owner_pid(pool_id)) or 0

    def _table_locked(self, pool_id: str) -> LeaseTable:
        table = self._tables.get(pool_id)
        if table is None:
            table = LeaseTable(Segment.attach(pool_id, None, shm_dir=self._shm_dir))
            self._tables[pool_id] = table
        return table

    def close(self) -> None:
        """Close every opened handle; views handed out before must be dropped first."""
        with self._lock:
            for (_, device), opened in self._opened.items():
                opened.buffer = None
                cuda_runtime().close(device, opened.ptr)
            self._opened.clear()
            for table in self._tables.values():
                table.close()
                table.segment.close()
            self._tables.clear()
