"""CUDA IPC consumer cache: handles opened from producers that died are closed once nothing views them
(an open handle pins the dead producer's GPU memory). Runs on CPU: the CUDA runtime and the device
wrap are replaced by fakes that record open/close; the producer's lease-table segment is real (in a
private directory, so no concurrent stale-segment sweep removes the dead producer's segment)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch
from omnistage.common.transport import cuda_ipc
from omnistage.v1 import tensor_pb2

POOL_BYTES = 1024

# A producer that creates its lease-table segment, prints the name, and dies without cleaning up.
PRODUCER = r"""
import os, sys
from omnistage.common.transport.host import Segment
from omnistage.common.transport.shm_pool import LeaseTable, table_bytes
seg = Segment.create(table_bytes(16), shm_dir=sys.argv[2])
LeaseTable.format(seg, 16, 0)
print(seg.name, flush=True)
if sys.argv[1] == "die":
    os._exit(0)
sys.stdin.readline()
"""


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


def _producer(mode: str, shm_dir) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, mode, str(shm_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    name = proc.stdout.readline().strip()
    assert name, "producer printed no segment name"
    return proc, name


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
    dead, dead_name = _producer("die", tmp_path)
    dead.wait(timeout=30)
    live, live_name = _producer("live", tmp_path)
    att = cuda_ipc.CudaIpcAttachments(shm_dir=str(tmp_path))
    try:
        view = att.view(_ref(dead_name), 0)
        assert view.numel() == 16 and att.num_open == 1
        del view
        gc.collect()
        att.view(_ref(live_name), 0)  # opening a new pool prunes the dead one
        assert fake_cuda.closed == [1], "the dead producer's handle stayed open (pins its GPU memory)"
        assert att.num_open == 1
    finally:
        att.close()
        live.stdin.write("\n")
        live.stdin.flush()
        live.wait(timeout=30)


def test_a_handle_still_viewed_is_kept_until_the_view_is_dropped(fake_cuda, tmp_path):
    dead, dead_name = _producer("die", tmp_path)
    dead.wait(timeout=30)
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
    live, live_name = _producer("live", tmp_path)
    att = cuda_ipc.CudaIpcAttachments(shm_dir=str(tmp_path))
    try:
        att.view(_ref(live_name), 0)
        assert att.prune_dead() == 0 and att.num_open == 1
    finally:
        att.close()
        assert fake_cuda.closed == [1]
        live.stdin.write("\n")
        live.stdin.flush()
        live.wait(timeout=30)
