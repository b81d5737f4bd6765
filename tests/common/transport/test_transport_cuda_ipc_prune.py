"""CUDA IPC consumer cache: handles opened from producers that died are closed once nothing views them
(an open handle pins the dead producer's GPU memory). Runs on CPU: the CUDA runtime and the device
wrap are replaced by fakes that record open/close; the producer's lease-table segment is real (in a
private directory, so no concurrent stale-segment sweep removes the dead producer's segment)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from omnistage.common.transport import cuda_ipc
from omnistage.v1 import tensor_pb2

from tests.common.transport.producers import Producer

POOL_BYTES = 1024


class FakeRuntime:
    def __init__(self) -> None:
        self.opened: list[int] = []
        self.closed: list[int] = []

    def open(self, device: int, raw: bytes) -> int:
        self.opened.append(len(self.opened) + 1)
        return self.opened[-1]

    def close(self, device: int, ptr: int) -> None:
        self.closed.append(ptr)


class _Holder:
    def __init__(self, nbytes: int) -> None:
        self.array = bytearray(nbytes)


def _fake_wrap(ptr: int, nbytes: int, device: int):
    holder = _Holder(nbytes)
    # The tensor keeps the bytearray alive; the bytearray's owner is the holder via this closure list.
    tensor = torch.frombuffer(holder.array, dtype=torch.uint8)
    tensor._omnistage_holder = holder  # slices keep this tensor alive through `._base`, as CUDA views do
    return tensor, weakref.ref(holder)


@pytest.fixture
def fake_cuda(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(cuda_ipc, "cuda_runtime", lambda: rt)
    monkeypatch.setattr(cuda_ipc, "_wrap", _fake_wrap)
    return rt


def _dead_producer(shm_dir) -> str:
    """The lease-table segment of a producer that died without cleaning up."""
    dead = Producer("lease_table", str(shm_dir))
    dead.tell()
    assert dead.wait() == 0
    return dead.name


def _ref(pool_id: str) -> tensor_pb2.CudaIpcRef:
    return tensor_pb2.CudaIpcRef(
        pool_id=pool_id,
        ipc_handle=b"\0" * 64,
        device_index=0,
        pool_byte_size=POOL_BYTES,
        offset=0,
        byte_size=16,
        lease_id=1,
    )


def test_handle_of_a_dead_producer_is_closed_when_another_pool_opens(fake_cuda, tmp_path):
    dead_name = _dead_producer(tmp_path)
    live = Producer("lease_table", str(tmp_path))
    att = cuda_ipc.CudaIpcAttachments(shm_dir=str(tmp_path))
    try:
        view = att.view(_ref(dead_name), 0)
        assert view.numel() == 16 and att.num_open == 1
        del view
        gc.collect()
        att.view(_ref(live.name), 0)  # opening a new pool prunes the dead one
        assert fake_cuda.closed == [1], "the dead producer's handle stayed open (pins its GPU memory)"
        assert att.num_open == 1
    finally:
        att.close()
        live.tell()
        live.wait()


def test_a_handle_still_viewed_is_kept_until_the_view_is_dropped(fake_cuda, tmp_path):
    dead_name = _dead_producer(tmp_path)
    att = cuda_ipc.CudaIpcAttachments(shm_dir=str(tmp_path))
    try:
        view = att.view(_ref(dead_name), 0)
        assert att.prune_dead() == 0, "closed a handle a consumer still reads"
        assert fake_cuda.closed == []
        del view
        gc.collect()
        assert att.prune_dead() == 1
        assert fake_cuda.closed == [1] and att.num_open == 0
    finally:
        att.close()


def test_a_live_producer_is_never_pruned(fake_cuda, tmp_path):
    live = Producer("lease_table", str(tmp_path))
    att = cuda_ipc.CudaIpcAttachments(shm_dir=str(tmp_path))
    try:
        att.view(_ref(live.name), 0)
        assert att.prune_dead() == 0 and att.num_open == 1
    finally:
        att.close()
        assert fake_cuda.closed == [1]
        live.tell()
        live.wait()
