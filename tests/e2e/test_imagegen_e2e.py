"""The image-generation stage alone through `omnistage serve` on the tiny checkpoint, over real gRPC.

The conditioning goes in as a TensorRef in this process's POSIX shm pool, as the thinker will send
it; the stream has one progress event per step, then a PNG that Pillow decodes at the requested
size; the same seed gives the same PNG. A client cancel stops the denoising (Describe shows nothing
running, progress stopped short); bad fields get INVALID_ARGUMENT naming them and the service keeps
serving; concurrent requests of one size share DiT forwards.
"""

from __future__ import annotations

import asyncio
import io
import time
import urllib.request

import grpc
import pytest
import torch
from omnistage.common.transport import TransportContext, encode
from omnistage.v1 import control_pb2, control_pb2_grpc, imagegen_pb2, imagegen_pb2_grpc, tensor_pb2
from PIL import Image

from tests.e2e.serve_pipeline import ServeProcess, exposition_with_codes, free_ports
from tests.waits import wait_for

pytestmark = pytest.mark.timeout(300)
QUERIES, HIDDEN = 256, 256  # the tiny checkpoint's query slots and thinker hidden size


@pytest.fixture(scope="module")
def imagegen(tmp_path_factory):
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("imagegen-e2e")
    ckpt = write_tiny_checkpoint(root / "ckpt", seed=0)
    port, admin_port, metrics_port = free_ports(3)
    cfg = {
        "model": {"checkpoint": str(ckpt)},
        "startup": {
            "phase_deadlines_s": {
                "starting": 60,
                "loading_weights": 120,
                "profiling_memory": 120,
                "warming_up": 120,
            }
        },
        "services": {
            "imagegen": {
                "kind": "imagegen",
                "port": port,
                "admin_port": admin_port,
                "metrics_port": metrics_port,
                "imagegen": {
                    "highres": 512,
                    "max_side_px": 1024,
                    "default_side_px": 512,
                    "max_steps": 50,
                    "stress_batch_sizes": [2, 1],
                },
                "memory": {"budget_bytes": 1 << 30, "simulated_capacity_bytes": 2 << 30},
            }
        },
    }
    serve = ServeProcess(root, cfg).wait_ready(240)
    with TransportContext() as producer:
        yield {
            "address": f"127.0.0.1:{port}",
            "admin": f"127.0.0.1:{admin_port}",
            "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            "producer": producer,
        }
    serve.stop()


def _condition(imagegen, seed: int = 0, dtype=torch.bfloat16) -> tensor_pb2.TensorRef:
    """The thinker's side: hidden states into our shm pool (256 x 256 bf16 = 128 KiB, above the inline bound)."""
    h = torch.randn(QUERIES, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)
    ref = encode(h, transport=imagegen["producer"])
    assert ref.WhichOneof("payload") == "shm"
    return ref


def _stub(imagegen):
    return imagegen_pb2_grpc.ImageGenStub(grpc.insecure_channel(imagegen["address"]))


def _describe(imagegen) -> control_pb2.DescribeResponse:
    with grpc.insecure_channel(imagegen["admin"]) as ch:
        return control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=5)


def _metric(imagegen, name: str) -> float:
    text = urllib.request.urlopen(imagegen["metrics"], timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _leases(imagegen) -> int:
    pool = imagegen["producer"].shm_pool()
    pool.arena.reclaim()
    return pool.arena.active_leases


def _generate(imagegen, **fields) -> list[imagegen_pb2.ImageGenEvent]:
    request = imagegen_pb2.ImageGenRequest(
        condition=_condition(imagegen, fields.pop("cond_seed", 0)), **fields
    )
    return list(_stub(imagegen).Generate(request, timeout=120))


def test_describe_reports_the_stress_cap_and_limits(imagegen):
    desc = _describe(imagegen)
    assert desc.kind == control_pb2.STAGE_KIND_IMAGEGEN and desc.progress.phase == control_pb2.PHASE_SERVING
    assert desc.limits.max_image_batch == 2 == desc.limits.max_running_requests
    assert (
        desc.limits.min_image_side_px,
        desc.limits.max_image_side_px,
        desc.limits.max_denoising_steps,
    ) == (64, 1024, 50)
    (mem,) = desc.memory
    assert mem.weights_bytes > 0 and mem.activation_peak_bytes > 0 and mem.budget_bytes == 1 << 30


def test_progress_per_step_then_a_png_of_the_requested_size(imagegen):
    events = _generate(imagegen, width=320, height=192, steps=5, seed=11)
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["progress"] * 5 + ["image"]
    assert [(e.progress.step, e.progress.total_steps) for e in events[:5]] == [(i, 5) for i in range(1, 6)]
    image = events[-1].image
    assert (image.width, image.height, image.seed, image.steps) == (320, 192, 11, 5)
    # 192/320 = 0.6: the 512 table's 0.6 bucket is 384 x 640 (h x w).
    assert (image.generated_height, image.generated_width) == (384, 640)
    png = Image.open(io.BytesIO(image.png))
    assert png.format == "PNG" and png.size == (320, 192) and png.mode == "RGB"
    assert _leases(imagegen) == 0  # the service copied the conditioning and released its lease


def test_same_seed_same_png_other_seed_other_png(imagegen):
    a = _generate(imagegen, width=128, height=128, steps=3, seed=5)[-1].image.png
    b = _generate(imagegen, width=128, height=128, steps=3, seed=5)[-1].image.png
    c = _generate(imagegen, width=128, height=128, steps=3, seed=6)[-1].image.png
    assert a == b and a != c


def test_an_edit_with_a_reference_image(imagegen):
    ref = io.BytesIO()
    Image.new("RGB", (300, 200), (200, 40, 40)).save(ref, format="JPEG")
    events = _generate(imagegen, width=192, height=128, steps=2, seed=3, reference_image=ref.getvalue())
    assert [e.WhichOneof("event") for e in events] == ["progress", "progress", "image"]
    assert Image.open(io.BytesIO(events[-1].image.png)).size == (192, 128)


def test_concurrent_requests_of_one_size_share_forwards(imagegen):
    before = (
        _metric(imagegen, "omnistage_imagegen_forwards_total"),
        _metric(imagegen, "omnistage_imagegen_forward_requests_total"),
    )

    async def run() -> list[list[imagegen_pb2.ImageGenEvent]]:
        async with grpc.aio.insecure_channel(imagegen["address"]) as ch:
            stub = imagegen_pb2_grpc.ImageGenStub(ch)

            async def one(seed: int):
                req = imagegen_pb2.ImageGenRequest(
                    condition=_condition(imagegen, seed), width=256, height=256, steps=8, seed=seed
                )
                return [e async for e in stub.Generate(req, timeout=120)]

            return await asyncio.gather(*(one(s) for s in range(4)))

    results = asyncio.run(run())
    assert all(len(r) == 9 and r[-1].WhichOneof("event") == "image" for r in results)
    forwards = _metric(imagegen, "omnistage_imagegen_forwards_total") - before[0]
    stepped = _metric(imagegen, "omnistage_imagegen_forward_requests_total") - before[1]
    assert stepped == 4 * 7  # the 8th step (sigma 0 → 0) moves nothing: no forward
    assert forwards < stepped  # requests shared forwards
    assert forwards >= stepped / 2  # never more than the stress-tested 2 per forward


def _cancel_at_step(imagegen, step: int) -> None:
    """A 50-step request cancelled by its client at progress `step`; returns once nothing is running."""
    request = imagegen_pb2.ImageGenRequest(
        condition=_condition(imagegen), width=512, height=512, steps=50, seed=1
    )
    call = _stub(imagegen).Generate(request, timeout=120)
    for event in call:
        if event.progress.step == step:
            call.cancel()
            break
    wait_for(
        lambda: _describe(imagegen).running_requests == 0,
        30,
        "the cancelled request to stop",
        stage="imagegen",
        poll_s=0.05,
    )


def test_cancel_stops_the_denoising(imagegen):
    stepped = "omnistage_imagegen_forward_requests_total"  # counted on the device thread
    before = _metric(imagegen, stepped)
    _cancel_at_step(imagegen, 2)
    assert _metric(imagegen, "omnistage_imagegen_active_requests") == 0
    assert _metric(imagegen, "omnistage_imagegen_cancelled_total") >= 1
    done = _metric(imagegen, stepped) - before
    assert 2 <= done < 20  # stopped a step or so after the cancel, far from the 49 forwards of 50 steps
    time.sleep(0.5)
    assert _metric(imagegen, stepped) - before == done  # nothing runs on
    # ...and it keeps serving.
    assert _generate(imagegen, width=64, height=64, steps=1)[-1].WhichOneof("event") == "image"


def _bad(imagegen, request: imagegen_pb2.ImageGenRequest) -> str:
    with pytest.raises(grpc.RpcError) as err:
        list(_stub(imagegen).Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"width": 100, "height": 128}, "width: 100 is not a multiple of 16"),
        ({"width": 128, "height": 2048}, "height: 2048 is outside [64, 1024]"),
        ({"width": 64, "height": 1024}, "aspect ratio"),
        ({"steps": 0}, "steps: must be at least 1"),
        ({"steps": -3}, "steps: must be at least 1"),
        ({"steps": 51}, "steps: 51 exceeds the limit of 50"),
        ({"guidance_scale": float("nan")}, "guidance_scale: must be a finite number"),
        ({"guidance_scale": -1.0}, "guidance_scale: must be >= 0"),
        ({"guidance_scale": 1e9}, "guidance_scale: 1e+09 exceeds the limit of 20"),
        ({"reference_image": b"\x89PNG\r\n\x1a\nnot really"}, "reference_image: "),
    ],
)
def test_bad_fields_are_named(imagegen, fields, needle):
    request = imagegen_pb2.ImageGenRequest(condition=_condition(imagegen), **fields)
    assert needle in _bad(imagegen, request)
    assert _leases(imagegen) == 0  # refused or not, the conditioning's lease came back


def test_bad_conditioning_is_named(imagegen):
    producer = imagegen["producer"]
    wrong_shape = encode(torch.randn(255, HIDDEN), transport=producer)
    assert "condition.shape: expected [256, 256], got [255, 256]" in _bad(
        imagegen, imagegen_pb2.ImageGenRequest(condition=wrong_shape)
    )
    wrong_dtype = encode(torch.zeros(QUERIES, HIDDEN, dtype=torch.int32), transport=producer)
    assert "condition.dtype: expected bfloat16, float16 or float32" in _bad(
        imagegen, imagegen_pb2.ImageGenRequest(condition=wrong_dtype)
    )
    nan = torch.randn(QUERIES, HIDDEN)
    nan[3, 4] = float("nan")
    assert "condition: contains NaN" in _bad(
        imagegen, imagegen_pb2.ImageGenRequest(condition=encode(nan, transport=producer))
    )
    assert "condition: required" in _bad(imagegen, imagegen_pb2.ImageGenRequest(width=64, height=64))
    short = tensor_pb2.TensorRef(
        dtype=tensor_pb2.DTYPE_FLOAT32, shape=[QUERIES, HIDDEN], inline_data=b"\0" * 10
    )
    assert "condition: inline TensorRef" in _bad(imagegen, imagegen_pb2.ImageGenRequest(condition=short))
    bogus = tensor_pb2.TensorRef(
        dtype=tensor_pb2.DTYPE_BFLOAT16,
        shape=[QUERIES, HIDDEN],
        host_id=producer.host_id,
        shm=tensor_pb2.ShmRef(
            pool_name="nope", pool_byte_size=1 << 20, byte_size=QUERIES * HIDDEN * 2, lease_id=1
        ),
    )
    assert "condition: refusing to map 'nope'" in _bad(
        imagegen, imagegen_pb2.ImageGenRequest(condition=bogus)
    )
    assert _leases(imagegen) == 0
    assert _generate(imagegen, width=64, height=64, steps=1)[-1].WhichOneof("event") == "image"


def test_metrics_pass_promtool_check_metrics(imagegen, check_metrics):
    """/metrics after this test's own traffic (an image, a refused request, a cancelled one), whatever ran
    before it: the labelled series they count are exported, and pass promtool (tests/deploy checks the names)."""
    assert _generate(imagegen, width=64, height=64, steps=1)[-1].WhichOneof("event") == "image"
    _bad(imagegen, imagegen_pb2.ImageGenRequest(condition=_condition(imagegen), steps=0))
    _cancel_at_step(imagegen, 1)
    text = exposition_with_codes(imagegen["metrics"], "OK", "INVALID_ARGUMENT", "CANCELLED")
    assert "omnistage_imagegen_cancelled_total{" in text and "omnistage_imagegen_images_total{" in text
    check_metrics(text)
