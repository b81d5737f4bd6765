"""Producer-owned POSIX shm pool: slices with leases that consumers release through the segment itself.

torch (and numpy) load in the functions that copy or view tensors: the lease table, its arena and a
consumer's release need neither, so a process that only releases leases (the gateway) never imports them.
"""

from __future__ import annotations

import bisect
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnistage.common.transport.host import SHM_DIR, Segment, TransportError, pid_alive
from omnistage.v1 import tensor_pb2

if TYPE_CHECKING:
    import torch

_MAGIC = int.from_bytes(b"OMNISHM1", "little")
_HEADER = struct.Struct("<QQQQ")  # magic, max_leases, data_offset, data_bytes
_HEADER_BYTES = 64
_SLOT_BITS = 20
_PAGE = 4096


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _now_ms() -> int:
    return int(time.time() * 1000)


def table_bytes(max_leases: int) -> int:
    """Bytes of header + lease table, rounded to a page: where the data region starts."""
    return _align(_HEADER_BYTES + 16 * max_leases, _PAGE)


class LeaseTable:
    """The shared header and lease slots at the start of a segment (both sides use it)."""

    def __init__(self, segment: Segment):
        self.segment = segment
        magic, self.max_leases, self.data_offset, self.data_bytes = _HEADER.unpack_from(segment.mm, 0)
        if magic != _MAGIC:
            raise TransportError(f"shm segment {segment.name} has no omnistage lease table")
        self._words = memoryview(segment.mm)[_HEADER_BYTES : _HEADER_BYTES + 16 * self.max_leases].cast("Q")

    @staticmethod
    def format(segment: Segment, max_leases: int, data_bytes: int) -> None:
        if not 0 < max_leases < (1 << _SLOT_BITS):
            raise ValueError(f"max_leases must be in (0, {1 << _SLOT_BITS}), got {max_leases}")
        _HEADER.pack_into(segment.mm, 0, _MAGIC, max_leases, table_bytes(max_leases), data_bytes)

    def grant(self, slot: int, lease_id: int) -> None:
        self._words[2 * slot] = lease_id

    def clear(self, slot: int) -> None:
        self._words[2 * slot] = 0

    def is_released(self, slot: int, lease_id: int) -> bool:
        return self._words[2 * slot + 1] == lease_id

    def release(self, lease_id: int) -> None:
        """Consumer side: mark `lease_id` released (ignored if the slot already moved on)."""
        slot = lease_id & ((1 << _SLOT_BITS) - 1)
        if lease_id == 0 or slot >= self.max_leases:
            raise TransportError(f"lease {lease_id} is not a lease of pool {self.segment.name}")
        if self._words[2 * slot] == lease_id:
            self._words[2 * slot + 1] = lease_id

    def close(self) -> None:
        self._words.release()


@dataclass(frozen=True)
class Lease:
    lease_id: int
    offset: int  # inside the data region
    byte_size: int
    expiry_unix_ms: int


class LeaseArena:
    """Producer bookkeeping for one pool: first-fit slices over a free list plus leases in a LeaseTable.

    Thread-safe. `allocate` never blocks longer than `wait_s`: it polls for consumer releases and
    returns None when the slice still does not fit, so the caller can fall back to inline bytes.
    """

    def __init__(self, table: LeaseTable, capacity: int, *, lease_ttl_s: float, alignment: int = 256):
        self.table = table
        self.capacity = capacity
        self.lease_ttl_s = lease_ttl_s
        self.alignment = alignment
        self.expired_total = 0
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # sorted (start, end)
        self._free_slots = list(range(table.max_leases - 1, -1, -1))
        self._active: dict[int, Lease] = {}  # slot -> lease
        self._seq = 0

    @classmethod
    def format(
        cls,
        segment: Segment,
        max_leases: int,
        capacity: int,
        *,
        data_in_segment: bool,
        lease_ttl_s: float,
        alignment: int,
    ) -> LeaseArena:
        """Write a lease table of `max_leases` slots at the start of `segment` and lease `capacity` bytes
        through it: the segment's own data region (shm) or memory elsewhere (a CUDA IPC buffer)."""
        LeaseTable.format(segment, max_leases, capacity if data_in_segment else 0)
        return cls(LeaseTable(segment), capacity, lease_ttl_s=lease_ttl_s, alignment=alignment)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self.capacity - sum(e - s for s, e in self._free)

    @property
    def active_leases(self) -> int:
        with self._lock:
            return len(self._active)

    def allocate(self, nbytes: int, *, wait_s: float = 0.0) -> Lease | None:
        """A leased slice of at least `nbytes`, or None if it does not fit within `wait_s` seconds."""
        size = _align(max(nbytes, 1), self.alignment)
        if size > self.capacity:
            return None
        deadline = time.monotonic() + wait_s
        pause = 0.0005
        while True:
            with self._lock:
                self._reclaim_locked()
                lease = self._take_locked(size)
            if lease is not None or time.monotonic() >= deadline:
                return lease
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 0.01)

    def fill(self, nbytes: int, copy: Callable[[Lease], None], *, wait_s: float = 0.0) -> Lease | None:
        """A lease of `nbytes` with `copy(lease)` done into it (None when it does not fit within `wait_s`);
        a copy that fails releases the lease again."""
        lease = self.allocate(nbytes, wait_s=wait_s)
        if lease is None:
            return None
        try:
            copy(lease)
        except BaseException:
            self.release(lease.lease_id)
            raise
        return lease

    def release(self, lease_id: int) -> bool:
        """Producer-side release (e.g. the send was aborted). False if the lease is not active."""
        with self._lock:
            lease = self._active.get(lease_id & ((1 << _SLOT_BITS) - 1))
            if lease is None or lease.lease_id != lease_id:
                return False
            self._free_locked(lease)
            return True

    def reclaim(self) -> int:
        """Free released and expired slices now; returns how many."""
        with self._lock:
            return self._reclaim_locked()

    def _take_locked(self, size: int) -> Lease | None:
        if not self._free_slots:
            return None
        for i, (start, end) in enumerate(self._free):
            if end - start >= size:
                if end - start == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, end)
                slot = self._free_slots.pop()
                self._seq += 1
                lease_id = (self._seq << _SLOT_BITS) | slot
                lease = Lease(lease_id, start, size, _now_ms() + int(self.lease_ttl_s * 1000))
                self._active[slot] = lease
                self.table.grant(slot, lease_id)
                return lease
        return None

    def _reclaim_locked(self) -> int:
        now = _now_ms()
        done = []
        for slot, lease in self._active.items():
            if self.table.is_released(slot, lease.lease_id):
                done.append(lease)
            elif now > lease.expiry_unix_ms:
                done.append(lease)
                self.expired_total += 1
        for lease in done:
            self._free_locked(lease)
        return len(done)

    def _free_locked(self, lease: Lease) -> None:
        slot = lease.lease_id & ((1 << _SLOT_BITS) - 1)
        del self._active[slot]
        self.table.clear(slot)
        self._free_slots.append(slot)
        start, end = lease.offset, lease.offset + lease.byte_size
        i = bisect.bisect_left(self._free, (start, end))
        if i < len(self._free) and self._free[i][0] == end:  # merge with the next range
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:  # merge with the previous range
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))


def _u8_view(segment: Segment, offset: int, nbytes: int) -> torch.Tensor:
    """Zero-copy uint8 tensor over the mapping; it pins the mapping (a fresh buffer export) while alive."""
    import torch

    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(memoryview(segment.mm), dtype=torch.uint8, count=nbytes, offset=offset)


def typed_view(u8: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Reinterpret a flat uint8 slice (aligned) as `dtype` with `shape`."""
    return u8.view(dtype).view(shape)


# Host copies up to this size are a single-threaded memcpy. torch's CPU copy is an OpenMP parallel
# region whose threads spin-wait afterwards, and the spinning threads of producer and consumer steal
# each other's cores: ~15 ms per hop for 1-16 MiB on a 16-core host. Above it, parallel page faulting
# wins (256 MiB: ~45 ms parallel vs ~250 ms memcpy per hop); see load_tests/transport_bench.py.
MEMCPY_MAX_BYTES = 32 << 20


def copy_bytes(dst_u8: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` (any device, any strides) into a flat uint8 host slice."""
    import numpy as np
    import torch

    nbytes = src.numel() * src.element_size()
    if 0 < nbytes <= MEMCPY_MAX_BYTES and src.device.type == "cpu" and src.is_contiguous():
        np.copyto(dst_u8.numpy(), src.detach().reshape(-1).view(torch.uint8).numpy())
    else:
        typed_view(dst_u8, src.dtype, tuple(src.shape)).copy_(src)


def clone_bytes(src_u8: torch.Tensor) -> torch.Tensor:
    """A fresh host copy of a flat uint8 host slice (memcpy or parallel, as in `copy_bytes`)."""
    import numpy as np
    import torch

    if src_u8.numel() > MEMCPY_MAX_BYTES:
        return src_u8.clone()
    out = torch.empty(src_u8.numel(), dtype=torch.uint8)
    if src_u8.numel():
        np.copyto(out.numpy(), src_u8.numpy())
    return out


class LeasedPool:
    """What both producer pools share (ShmPool here, CudaIpcPool on a GPU): a lease arena whose table
    lives in a shared segment, the lease fields of every ref, and one close."""

    def __init__(
        self,
        segment: Segment,
        max_leases: int,
        data_bytes: int,
        *,
        data_in_segment: bool,
        lease_ttl_s: float,
        alignment: int,
    ) -> None:
        self.segment = segment
        self.arena = LeaseArena.format(
            segment,
            max_leases,
            data_bytes,
            data_in_segment=data_in_segment,
            lease_ttl_s=lease_ttl_s,
            alignment=alignment,
        )
        self.table = self.arena.table
        self._closed = False

    @staticmethod
    def lease_fields(lease: Lease, nbytes: int) -> dict[str, int]:
        """The fields every ref carries about its slice and lease (ShmRef and CudaIpcRef alike)."""
        return {"byte_size": nbytes, "lease_id": lease.lease_id, "lease_expiry_unix_ms": lease.expiry_unix_ms}

    def close(self) -> None:
        """Unlink and unmap; safe to call twice and from atexit."""
        if self._closed:
            return
        self._closed = True
        self._close_data()
        self.table.close()
        self.segment.close()

    def _close_data(self) -> None:
        """Let go of the data kept outside the segment (ShmPool keeps none)."""


class ShmPool(LeasedPool):
    """One producer-owned segment per process: `put` copies a tensor into a leased slice and returns the ref."""

    def __init__(
        self,
        data_bytes: int,
        *,
        lease_ttl_s: float = 60.0,
        max_leases: int = 4096,
        alignment: int = 256,
        reserve: bool = True,
        shm_dir: str = SHM_DIR,
    ):
        if data_bytes <= 0 or alignment % 64 or _PAGE % alignment:
            raise ValueError(f"bad pool geometry: data_bytes={data_bytes} alignment={alignment}")
        data_bytes = _align(data_bytes, _PAGE)
        segment = Segment.create(table_bytes(max_leases) + data_bytes, shm_dir=shm_dir, reserve=reserve)
        super().__init__(
            segment,
            max_leases,
            data_bytes,
            data_in_segment=True,
            lease_ttl_s=lease_ttl_s,
            alignment=alignment,
        )

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def owner_pid(self) -> int:
        return self.segment.owner_pid

    def put(self, tensor: torch.Tensor, *, wait_s: float = 0.0) -> tensor_pb2.ShmRef | None:
        """Copy `tensor` (any strides/device) into a new slice; None if the pool cannot fit it in time."""
        nbytes = tensor.numel() * tensor.element_size()
        base = self.table.data_offset
        lease = self.arena.fill(
            nbytes,
            lambda lease: copy_bytes(_u8_view(self.segment, base + lease.offset, nbytes), tensor),
            wait_s=wait_s,
        )
        if lease is None:
            return None
        offset = base + lease.offset
        return tensor_pb2.ShmRef(
            pool_name=self.segment.name,
            pool_byte_size=self.segment.byte_size,
            offset=offset,
            **self.lease_fields(lease, nbytes),
        )


class ShmAttachments:
    """Consumer side: each producer's pool is mapped once and cached by name. Thread-safe."""

    def __init__(self, shm_dir: str = SHM_DIR):
        self._shm_dir = shm_dir
        self._lock = threading.Lock()
        self._pools: dict[str, LeaseTable] = {}

    def view(self, ref: tensor_pb2.ShmRef) -> torch.Tensor:
        """Zero-copy uint8 view of the slice named by `ref` (validated against the pool's layout)."""
        table = self._table(ref.pool_name, ref.pool_byte_size)
        if ref.offset < table.data_offset or ref.offset + ref.byte_size > ref.pool_byte_size:
            raise TransportError(
                f"shm ref [{ref.offset}, +{ref.byte_size}) lies outside the data region of {ref.pool_name}"
            )
        return _u8_view(table.segment, ref.offset, ref.byte_size)

    def release(self, ref: tensor_pb2.ShmRef) -> None:
        """Give the slice back to its producer (a store into the shared lease table)."""
        self._table(ref.pool_name, ref.pool_byte_size).release(ref.lease_id)

    def _table(self, name: str, byte_size: int) -> LeaseTable:
        with self._lock:
            table = self._pools.get(name)
            if table is None:
                self._prune_dead_locked()
                table = LeaseTable(Segment.attach(name, byte_size, shm_dir=self._shm_dir))
                self._pools[name] = table
            elif table.segment.byte_size != byte_size:
                raise TransportError(
                    f"shm ref says {name} has {byte_size} bytes, mapped {table.segment.byte_size}"
                )
            return table

    def _prune_dead_locked(self) -> None:
        for name, table in list(self._pools.items()):
            if not pid_alive(table.segment.owner_pid or 0):
                del self._pools[name]
                table.close()
                table.segment.close()

    def close(self) -> None:
        with self._lock:
            for table in self._pools.values():
                table.close()
                table.segment.close()
            self._pools.clear()
