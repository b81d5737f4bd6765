"""On a GPU: embeddings stay on the device through CUDA IPC when the consumer may open it, and go
through POSIX shm otherwise (skipped without CUDA)."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys

import pytest
import torch
from omnistage.common.transport import decode
from omnistage.services.encoder.items import MediaItem
from omnistage.services.encoder.models.loader import load_encoders

from tests.services.encoder.engine_helpers import run_engine
from tests.services.encoder.media_samples import image_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONSUMER = r"""
import base64, sys, torch
from omnistage.common.transport import TransportContext, decode
from omnistage.v1 import tensor_pb2
ctx = TransportContext()
ref = tensor_pb2.TensorRef.FromString(base64.b64decode(sys.stdin.read()))
y = decode(ref, transport=ctx, device="cuda:0")
print(ref.WhichOneof("payload"), y.is_cuda, float(y.float().abs().sum()), flush=True)
ctx.close()
"""


def test_gpu_outputs_go_by_cuda_ipc_when_allowed_and_by_shm_otherwise(tiny_ckpt):
    models = load_encoders(tiny_ckpt, dtype=torch.bfloat16, device="cuda:0")
    image = MediaItem("image", data=image_bytes(300, 200))

    async def body(engine):
        (shm,) = await engine.encode([image])
        (ipc,) = await engine.encode([image], allow_cuda_ipc=True)
        local = decode(shm.ref, transport=engine.transport)
        proc = subprocess.run(
            [sys.executable, "-c", CONSUMER],
            input=base64.b64encode(ipc.ref.SerializeToString()).decode(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        return shm.ref.WhichOneof("payload"), local, proc

    kind, local, proc = run_engine(models, body)
    assert kind == "shm" and local.dtype == torch.bfloat16 and not local.is_cuda
    assert proc.returncode == 0, proc.stderr[-2000:]
    payload, on_gpu, total = proc.stdout.split()
    assert payload == "cuda" and on_gpu == "True"
    assert float(total) == pytest.approx(float(local.float().abs().sum()), rel=1e-2)


def test_a_hand_over_does_not_wait_for_the_forward_launched_after_it(tiny_ckpt):
    """The device thread launches its next forward while a finished one's outputs are handed over: their
    copy into the pool runs on a stream of its own, so the answer does not wait for that forward."""
    models = load_encoders(tiny_ckpt, dtype=torch.bfloat16, device="cuda:0")

    async def body(engine):
        await engine.encode([MediaItem("image", data=image_bytes(64, 64))])  # warm: the pool, the stream
        out = torch.randn(64, 32, device="cuda:0", dtype=torch.bfloat16)  # a finished forward's rows
        torch.cuda.synchronize()
        busy = torch.cuda.Event()

        def next_forward() -> None:  # on the device thread's stream, as the next forward's kernels are
            torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU time
            busy.record()

        await asyncio.wrap_future(engine.loop.call(next_forward))
        loop = asyncio.get_running_loop()
        (ref,) = await loop.run_in_executor(None, engine._to_refs, [out], "", True)
        still_busy = not busy.query()
        rows = decode(ref, transport=engine.transport, device="cuda:0")
        torch.cuda.synchronize()
        return still_busy, ref.WhichOneof("payload"), torch.equal(rows, out)

    assert run_engine(models, body) == (True, "cuda", True)
