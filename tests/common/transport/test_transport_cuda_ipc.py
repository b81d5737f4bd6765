"""CUDA IPC between two processes: this one exports its pool, a subprocess opens it once and reads slices."""

import base64
import subprocess
import sys

import pytest
import torch
from omnistage.common.transport import TransportContext, TransportOptions, decode, encode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONSUMER = r"""
import base64, sys, torch
from omnistage.common.transport import TransportContext, decode
from omnistage.v1 import tensor_pb2
ctx = TransportContext()
for line in sys.stdin:
    mode, tag, b64 = line.split()
    ref = tensor_pb2.TensorRef.FromString(base64.b64decode(b64))
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[mode.split("-")[1]]
    expected = (torch.arange(1 << 18, dtype=torch.float32) + int(tag)).to(dtype)
    try:
        if mode.startswith("view"):
            y = decode(ref, transport=ctx, copy=False)
            assert y.is_cuda
            ok = torch.equal(y.cpu(), expected)
            del y
            ctx.release(ref)
        elif mode.startswith("cpu"):
            y = decode(ref, transport=ctx, device="cpu")
            ok = not y.is_cuda and torch.equal(y, expected)
        else:
            y = decode(ref, transport=ctx)
            ok = y.is_cuda and torch.equal(y.cpu(), expected)
        print("ok" if ok else "bad", tag, ctx.cuda_attachments.num_open, flush=True)
    except Exception as e:
        print("err", tag, repr(e).replace(chr(10), " "), flush=True)
ctx.close()
"""


@pytest.fixture
def consumer():
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


def _ask(proc, mode, tag, ref):
    proc.stdin.write(f"{mode} {tag} {base64.b64encode(ref.SerializeToString()).decode()}\n")
    proc.stdin.flush()
    answer = proc.stdout.readline().split()  # EOF (consumer died) gives [], never a hang
    assert answer[:2] == ["ok", str(tag)], f"consumer answered {answer} for {mode} {tag}"
    return int(answer[2])


def test_two_process_round_trip_with_lease_release(consumer):
    opts = TransportOptions(cuda_pool_bytes=4 << 20, shm_threshold_bytes=0, alloc_wait_s=5.0)
    with TransportContext(opts) as ctx:
        for i, mode in enumerate(["copy-f32", "cpu-f32", "view-f32", "copy-bf16"] * 4):
            dtype = torch.bfloat16 if mode.endswith("bf16") else torch.float32
            x = (torch.arange(1 << 18, dtype=torch.float32, device="cuda") + i).to(dtype)  # 1 MiB or 512 KiB
            ref = encode(x, transport=ctx)
            assert ref.WhichOneof("payload") == "cuda" and ref.cuda.device_index == x.device.index
            pool = ctx.cuda_pool(x.device.index)
            assert pool.arena.active_leases >= 1
            opened = _ask(consumer, mode, i, ref)
            assert opened == 1  # the pool handle is opened once and cached
            assert pool.arena.reclaim() == 1 and pool.arena.active_leases == 0
        # 16 tensors of up to 1 MiB went through a 4 MiB pool: slices were released and reused


def test_same_process_decode_uses_the_local_pool():
    with TransportContext(TransportOptions(cuda_pool_bytes=1 << 20, shm_threshold_bytes=0)) as ctx:
        x = torch.randn(1000, device="cuda").to(torch.bfloat16)
        ref = encode(x, transport=ctx)
        assert ref.WhichOneof("payload") == "cuda"
        y = decode(ref, transport=ctx)
        assert torch.equal(y.view(torch.int16), x.view(torch.int16))
        assert ctx.cuda_pool(x.device.index).arena.reclaim() == 1


def test_cuda_tensor_goes_through_shm_when_cuda_ipc_is_off():
    opts = TransportOptions(enable_cuda_ipc=False, shm_pool_bytes=1 << 20, shm_threshold_bytes=0)
    with TransportContext(opts) as ctx:
        x = torch.arange(100, device="cuda")
        ref = encode(x, transport=ctx)
        assert ref.WhichOneof("payload") == "shm"
        assert torch.equal(decode(ref, transport=ctx, device=x.device), x)
