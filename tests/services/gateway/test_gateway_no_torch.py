"""The gateway never imports torch: it only ends the leases of refs other stages produced (a store into
the producer's lease table), and torch costs every gateway start seconds of CPU and hundreds of MB.

A fresh interpreter imports the gateway's entry module and does what its media path does with a
`TransportContext`: releases a shm ref and a CUDA IPC ref that this process leased, then closes it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from omnistage.common.transport import TransportContext, TransportOptions, encode
from omnistage.common.transport.host import Segment
from omnistage.common.transport.shm_pool import LeaseArena, table_bytes
from omnistage.v1 import tensor_pb2

GATEWAY = """
import json, sys
import omnistage.services.gateway.__main__
from omnistage.common.transport import TransportContext, TransportOptions
from omnistage.common.transport.release import release_quietly
from omnistage.v1 import tensor_pb2

transport = TransportContext(TransportOptions(shm_dir=sys.argv[1]))
for raw in sys.argv[2:]:
    release_quietly(transport, tensor_pb2.TensorRef.FromString(bytes.fromhex(raw)), "test lease")
transport.close()
with open("/proc/self/maps") as maps:
    libtorch = "libtorch" in maps.read()
print(json.dumps({"torch": "torch" in sys.modules, "libtorch": libtorch}))
"""


def _cuda_lease(shm_dir: str) -> tuple[LeaseArena, Segment, tensor_pb2.TensorRef]:
    """A CUDA IPC producer's lease table (real; the device buffer it leases is never touched by a
    release) with one lease granted, and the ref a consumer would get for it."""
    segment = Segment.create(table_bytes(16), shm_dir=shm_dir)
    arena = LeaseArena.format(segment, 16, 1 << 16, data_in_segment=False, lease_ttl_s=60.0, alignment=256)
    lease = arena.allocate(1024)
    cuda = tensor_pb2.CudaIpcRef(
        pool_id=segment.name, pool_byte_size=1 << 16, byte_size=1024, lease_id=lease.lease_id
    )
    return arena, segment, tensor_pb2.TensorRef(cuda=cuda)


def test_the_gateway_releases_shm_and_cuda_ipc_leases_without_importing_torch(tmp_path):
    shm_dir = str(tmp_path)
    with TransportContext(TransportOptions(shm_pool_bytes=1 << 20, shm_dir=shm_dir)) as producer:
        shm_ref = encode(torch.arange(4096, dtype=torch.int64), transport=producer, force="shm")
        cuda_arena, segment, cuda_ref = _cuda_lease(shm_dir)
        try:
            refs = [ref.SerializeToString().hex() for ref in (shm_ref, cuda_ref)]
            done = subprocess.run(
                [sys.executable, "-c", GATEWAY, shm_dir, *refs], capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, done.stderr
            assert "not released" not in done.stderr, done.stderr
            assert json.loads(done.stdout) == {"torch": False, "libtorch": False}
            assert producer.shm_pool().arena.reclaim() == 1 and producer.shm_pool().arena.expired_total == 0
            assert cuda_arena.reclaim() == 1 and cuda_arena.expired_total == 0
        finally:
            cuda_arena.table.close()
            segment.close()
