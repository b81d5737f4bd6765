"""Device-memory accountants: the one interface every budgeting decision reads."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from omnistage.common.memory.units import MiB, fmt_bytes
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# The CUDA caching allocator rounds every block to 512 bytes and maps large blocks in 2 MiB pages.
BLOCK_ROUND = 512
SEGMENT_BYTES = 2 * MiB
# Requests of 1-10 MiB share 20 MiB segments with other tensors, so freeing one need not drop reserved
# memory; only a request above this has segments of its own.
OWN_SEGMENT_MIN_BYTES = 10 * MiB
SHARED_SEGMENT_BYTES = 20 * MiB


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class MemoryStats:
    """One reading of a device, for logs and reports (all bytes)."""

    device: str
    total: int
    free: int
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int


@runtime_checkable
class DeviceMemory(Protocol):
    """What budgeting code may ask of a device (real or simulated)."""

    device_name: str
    # The most a reserved peak may round above the allocations it holds: a sizing that fills a
    # budget to its last byte leaves this much for the segment the peak opens.
    segment_bytes: int

    def total(self) -> int: ...
    def free(self) -> int: ...
    def allocated(self) -> int: ...
    def reserved(self) -> int: ...
    def peak_allocated(self) -> int: ...
    def peak_reserved(self) -> int: ...
    def reset_peak(self) -> None: ...
    def empty_cache(self) -> None: ...
    def meter(self) -> contextlib.AbstractContextManager[Any]: ...
    def stats(self) -> MemoryStats: ...


def _stats(mem: DeviceMemory) -> MemoryStats:
    return MemoryStats(
        device=mem.device_name,
        total=mem.total(),
        free=mem.free(),
        allocated=mem.allocated(),
        reserved=mem.reserved(),
        peak_allocated=mem.peak_allocated(),
        peak_reserved=mem.peak_reserved(),
    )


class CudaDeviceMemory:
    """One CUDA device as torch's caching allocator and the driver see it.

    `free()` is the driver's free memory (other processes' use included), `reserved()` is this
    process's caching-allocator footprint; `total - free - reserved` is everyone else (peers,
    CUDA context, NCCL buffers).
    """

    def __init__(self, device_index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"CudaDeviceMemory(cuda:{device_index}): torch.cuda is not available")
        self.index = device_index
        self.device = torch.device("cuda", device_index)
        self.device_name = f"cuda:{device_index}"
        self.segment_bytes = SHARED_SEGMENT_BYTES

    def total(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[1])

    def free(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[0])

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def peak_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def peak_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def set_limit(self, nbytes: int) -> None:
        """Make the caching allocator refuse to reserve more than `nbytes` (the service's budget)."""
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / self.total()), self.device)

    def meter(self) -> contextlib.AbstractContextManager[Any]:
        """The CUDA allocator meters everything already."""
        return contextlib.nullcontext(self)

    def stats(self) -> MemoryStats:
        return _stats(self)


@dataclass(eq=False)
class Reservation:
    """Device memory held by something that is not a tensor of this process (IPC pool, peer, context)."""

    owner: SimulatedDeviceMemory
    nbytes: int
    label: str

    def release(self) -> None:
        self.owner._release_reservation(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(eq=False)
class SyntheticAllocation:
    """Bytes counted as tensor memory without a tensor (synthetic stages); `free()` returns them."""

    owner: SimulatedDeviceMemory
    key: int
    nbytes: int

    def free(self) -> None:
        self.owner._free_key(self.key)


class _Meter(TorchDispatchMode):
    """Counts the storage of every tensor an aten op creates while active."""

    def __init__(self, owner: SimulatedDeviceMemory) -> None:
        super().__init__()
        self.owner = owner

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No dynamo wrapper around `__torch_dispatch__` (torch's opt-out): nothing here is compiled,
        and the wrapper's first call imports torch._dynamo and sympy (~2 s of CPU in every process
        that meters a simulated device)."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.owner._on_tensor(t, inputs)
        return out


def _storage_key(t: torch.Tensor) -> int | None:
    if t.device.type == "meta" or t.is_sparse or t.is_nested:
        return None
    return t.untyped_storage()._cdata


class SimulatedDeviceMemory:
    """A device of `capacity_bytes` whose use is metered from real CPU tensors inside `meter()`.

    Allocator model: every storage is rounded to 512 bytes (`allocated`); `reserved` grows in
    `segment_bytes` steps when allocated exceeds it, and shrinks only in `empty_cache()` to
    allocated rounded up to a segment (fragmentation is not modelled, so this is a lower bound of
    what CUDA would hold). An allocation that would push reserved + reservations past the limit
    raises `torch.OutOfMemoryError` and is not counted.
    """

    def __init__(self, capacity_bytes: int, *, segment_bytes: int = SEGMENT_BYTES, name: str = "sim") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"SimulatedDeviceMemory: capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.segment_bytes = int(segment_bytes)
        self.device_name = name
        self.limit = self.capacity
        self._lock = threading.RLock()
        self._live: dict[int, int] = {}  # storage key (or synthetic key) -> counted bytes
        self._reservations: list[Reservation] = []
        self._synthetic_keys = itertools.count(-1, -1)
        self._allocated = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0

    # -- readings --------------------------------------------------------------------------
    def total(self) -> int:
        return self.capacity

    def free(self) -> int:
        with self._lock:
            return self.capacity - self._reserved - self.reserved_elsewhere()

    def allocated(self) -> int:
        return self._allocated

    def reserved(self) -> int:
        return self._reserved

    def peak_allocated(self) -> int:
        return self._peak_allocated

    def peak_reserved(self) -> int:
        return self._peak_reserved

    def reserved_elsewhere(self) -> int:
        """Bytes held through `reserve()` (not tensors of this process)."""
        with self._lock:
            return sum(r.nbytes for r in self._reservations)

    def reservations(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for r in self._reservations:
                out[r.label] = out.get(r.label, 0) + r.nbytes
            return out

    def stats(self) -> MemoryStats:
        return _stats(self)

    # -- control ---------------------------------------------------------------------------
    def reset_peak(self) -> None:
        with self._lock:
            self._peak_allocated = self._allocated
            self._peak_reserved = self._reserved

    def empty_cache(self) -> None:
        with self._lock:
            self._reserved = _round_up(self._allocated, self.segment_bytes)

    def set_limit(self, nbytes: int) -> None:
        """Refuse to reserve past `nbytes` (a service's budget on a shared device)."""
        self.limit = min(int(nbytes), self.capacity)

    @contextlib.contextmanager
    def meter(self) -> Iterator[SimulatedDeviceMemory]:
        """Count every tensor created in this thread while inside (frees count until they die)."""
        with _Meter(self):
            yield self

    def track(self, *tensors: torch.Tensor) -> int:
        """Count tensors made before metering began (weights); returns the bytes newly counted."""
        added = 0
        for t in tensors:
            before = self._allocated
            self._on_tensor(t, set())
            added += self._allocated - before
        return added

    def allocate_bytes(self, nbytes: int) -> SyntheticAllocation:
        """Count `nbytes` of tensor memory with no tensor behind it; `handle.free()` returns it."""
        key = next(self._synthetic_keys)
        counted = self._charge(key, int(nbytes), what=f"{fmt_bytes(nbytes)} (synthetic)")
        return SyntheticAllocation(self, key, counted)

    def reserve(self, nbytes: int, label: str) -> Reservation:
        """Hold `nbytes` outside the caching allocator (a CUDA IPC pool, a peer process, a canary)."""
        with self._lock:
            self._check_fits(self._reserved + int(nbytes), f"{fmt_bytes(nbytes)} reservation {label!r}")
            r = Reservation(self, int(nbytes), label)
            self._reservations.append(r)
            return r

    # -- internals -------------------------------------------------------------------------
    def _release_reservation(self, r: Reservation) -> None:
        with self._lock:
            if r in self._reservations:
                self._reservations.remove(r)

    def _check_fits(self, reserved_after: int, what: str) -> None:
        elsewhere = self.reserved_elsewhere()
        if reserved_after + elsewhere > self.limit:
            raise torch.OutOfMemoryError(
                f"{self.device_name}: out of memory (simulated): tried to allocate {what}; "
                f"limit {fmt_bytes(self.limit)} of capacity {fmt_bytes(self.capacity)}, "
                f"{fmt_bytes(self._allocated)} allocated, {fmt_bytes(self._reserved)} reserved by this process, "
                f"{fmt_bytes(elsewhere)} held elsewhere"
            )

    def _charge(self, key: int, nbytes: int, what: str) -> int:
        """Count `nbytes` more for `key`; on OOM collect garbage and retry once, as the CUDA caching
        allocator frees its cached blocks and retries before it raises. Without this, storages kept
        alive only by reference cycles made the measured peak depend on when Python's GC last ran."""
        try:
            return self._charge_once(key, nbytes, what)
        except torch.OutOfMemoryError:
            gc.collect()  # finalizers of dead storages run here (the lock is reentrant)
            return self._charge_once(key, nbytes, what)

    def _charge_once(self, key: int, nbytes: int, what: str) -> int:
        """Count `nbytes` more for `key`; grow reserved by segments; OOM past the limit."""
        counted = _round_up(nbytes, BLOCK_ROUND) if nbytes else 0
        with self._lock:
            allocated = self._allocated + counted
            reserved = max(self._reserved, _round_up(allocated, self.segment_bytes))
            if reserved > self._reserved:
                self._check_fits(reserved, what)
            self._live[key] = self._live.get(key, 0) + counted
            self._allocated = allocated
            self._reserved = reserved
            self._peak_allocated = max(self._peak_allocated, allocated)
            self._peak_reserved = max(self._peak_reserved, reserved)
        return counted

    def _free_key(self, key: int) -> None:
        with self._lock:
            self._allocated -= self._live.pop(key, 0)

    def _on_tensor(self, t: torch.Tensor, input_keys: set[int | None]) -> None:
        key = _storage_key(t)
        if key is None:
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        with self._lock:
            have = self._live.get(key)
            if have is None and key in input_keys:
                return  # a view or in-place result of a tensor created outside metering
            grow = _round_up(nbytes, BLOCK_ROUND) - (have or 0) if nbytes else 0
            if have is not None and grow <= 0:
                return  # a view or in-place result of a counted storage
            shape = "x".join(map(str, t.shape)) or "scalar"
            self._charge(key, nbytes - (have or 0), what=f"{fmt_bytes(grow)} ({t.dtype} [{shape}])")
            if have is None:
                weakref.finalize(storage, self._free_key, key)


def host_memory_bytes() -> int:
    """Physical RAM of this host (the capacity of an unbudgeted CPU 'device')."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory_for(device: str, simulated_capacity: int | None = None) -> DeviceMemory:
    """The accountant of `device` ("cuda", "cuda:1", "cpu").

    CPU gets a SimulatedDeviceMemory of `simulated_capacity` bytes (host RAM when not given); a
    CUDA device gets a CudaDeviceMemory unless `simulated_capacity` asks for a simulation.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not simulated_capacity:
        return CudaDeviceMemory(dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device_memory_for({device!r}): expected 'cpu' or 'cuda[:N]'")
    capacity = simulated_capacity or host_memory_bytes()
    return SimulatedDeviceMemory(capacity, name=f"{device}-sim")
