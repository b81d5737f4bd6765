"""The encoder stage alone through `omnistage serve` on the tiny checkpoint, over real gRPC.

The embeddings come back as shm TensorRefs; decoded as a consumer would (common/transport), they equal
the towers' output computed in this process from the same checkpoint. Concurrent requests share
forwards (the batch counters on /metrics); bad items fail with INVALID_ARGUMENT naming the item; the
producer's leases are all released (Describe / decode) once consumers have decoded.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from omnistage.common.config import EncoderConfig
from omnistage.common.transport import TransportContext, decode, encode
from omnistage.v1 import control_pb2, control_pb2_grpc, encoder_pb2, encoder_pb2_grpc, tensor_pb2

from tests.e2e.serve_pipeline import ServeProcess, exposition_with_codes, free_ports
from tests.services.encoder.media_samples import audio_file, image_bytes, video_file

pytestmark = pytest.mark.timeout(600)

LIMITS = {
    "image_max_pixels": 512 * 512,
    "video_min_pixels": 64 * 64,
    "video_total_pixels": 16 * 128 * 128,
    "max_video_frames": 16,
    "max_audio_seconds": 3.0,
    "max_items_per_request": 4,
    "stress_batch_sizes": [4, 2, 1],
    "inline_max_bytes": 1024,  # the tiny model's embeddings are small: shm for all of them
}


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("enc-e2e")
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
            "encoder": {
                "kind": "encoder",
                "port": port,
                "admin_port": admin_port,
                "metrics_port": metrics_port,
                "encoder": LIMITS,
                "memory": {"budget_bytes": 1 << 30, "simulated_capacity_bytes": 2 << 30},
            }
        },
    }
    serve = ServeProcess(root, cfg).wait_ready(300)
    yield {
        "address": f"127.0.0.1:{port}",
        "admin": f"127.0.0.1:{admin_port}",
        "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
        "ckpt": ckpt,
    }
    serve.stop()


@pytest.fixture(scope="module")
def towers(encoder):
    from omnistage.services.encoder.items import ItemLimits
    from omnistage.services.encoder.models.loader import load_encoders

    models = load_encoders(encoder["ckpt"], dtype=torch.float32, device="cpu")
    return models, ItemLimits.of(EncoderConfig(**{**LIMITS, "stress_batch_sizes": (4, 2, 1)}), models.config)


def _stub(encoder):
    return encoder_pb2_grpc.EncoderStub(grpc.insecure_channel(encoder["address"]))


def _describe(encoder) -> control_pb2.DescribeResponse:
    with grpc.insecure_channel(encoder["admin"]) as ch:
        return control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=5)


def _metric(encoder, name: str, modality: str) -> float:
    text = urllib.request.urlopen(encoder["metrics"], timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and f'modality="{modality}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


IMAGE = image_bytes(500, 340)
AUDIO = audio_file("wav", 2.9, rate=44100, channels=2)  # 73 tokens: above the 64 KiB inline bound
VIDEO = video_file(30, fps=10, width=160, height=96)


def test_describe_reports_the_stress_result_and_limits(encoder):
    desc = _describe(encoder)
    assert desc.kind == control_pb2.STAGE_KIND_ENCODER and desc.progress.phase == control_pb2.PHASE_SERVING
    assert desc.limits.max_vision_batch_items == 4 and desc.limits.max_audio_batch_items == 4
    assert desc.limits.max_items_per_request == 4
    (mem,) = desc.memory
    assert mem.budget_bytes == 1 << 30 and mem.weights_bytes > 0 and mem.activation_peak_bytes > 0
    assert mem.total_bytes >= mem.weights_bytes + mem.activation_peak_bytes


def test_image_audio_and_video_come_back_as_shm_refs_equal_to_the_towers(encoder, towers):
    from omnistage.services.encoder.items import MediaItem, prepare_item
    from omnistage.services.encoder.runner import vision_forward

    models, limits = towers
    request = encoder_pb2.EncodeRequest(
        request_id="e2e",
        items=[
            encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_IMAGE, data=IMAGE),
            encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_AUDIO, data=AUDIO),
            encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_VIDEO, data=VIDEO),
        ],
    )
    response = _stub(encoder).Encode(request, timeout=60)
    assert response.spatial_merge_size == 2
    ph = models.config.placeholders
    image, audio, video = response.items
    with TransportContext() as consumer:
        rows = [decode(item.embeddings, transport=consumer) for item in response.items]
    for item, got, (kind, data) in zip(
        response.items, rows, [("image", IMAGE), ("audio", AUDIO), ("video", VIDEO)], strict=True
    ):
        assert item.embeddings.WhichOneof("payload") == "shm", kind
        x = prepare_item(MediaItem(kind, data=data), limits)
        want = (
            models.audio.encode_items([x.mel]) if kind == "audio" else vision_forward(models, [x.frames])
        )[0]
        assert got.shape == (item.num_tokens, 256) and torch.allclose(got, want, atol=1e-5), kind
    assert image.placeholder_token_id == ph.image_patch and audio.placeholder_token_id == ph.audio_patch
    assert video.placeholder_token_id == ph.video_patch
    assert [(g.t, g.h, g.w) for g in image.merged_grids] == [(1, 11, 16)] and image.num_tokens == 176
    assert (image.resized_height, image.resized_width) == (352, 512)
    assert audio.num_tokens == 73 and audio.duration_s == pytest.approx(2.9) and not audio.merged_grids
    # 30 frames at 10 fps: 2 fps → 6 frames (0, 6, 12, 17, 23, 29) → 3 temporal patches.
    assert len(video.merged_grids) == 3 == len(video.timestamps_s)
    assert video.timestamps_s[0] == pytest.approx(0.3) and video.timestamps_s[-1] == pytest.approx(2.6)
    assert video.num_tokens == sum(g.t * g.h * g.w for g in video.merged_grids)


def test_decoded_samples_through_a_tensor_ref(encoder, towers):
    models, limits = towers
    samples = torch.from_numpy(np.sin(np.arange(24000) / 5).astype(np.float32))
    with TransportContext() as producer:
        ref = encode(samples, transport=producer)  # 96 KB: a shm ref of this (client) process
        assert ref.WhichOneof("payload") == "shm"
        response = _stub(encoder).Encode(
            encoder_pb2.EncodeRequest(
                items=[
                    encoder_pb2.EncodeItem(
                        kind=encoder_pb2.MEDIA_KIND_AUDIO, samples=ref, sample_rate_hz=12000
                    )
                ]
            ),
            timeout=60,
        )
        pool = producer.shm_pool()
        pool.arena.reclaim()
        assert pool.arena.active_leases == 0  # the encoder decoded (copied and released) our samples
        (item,) = response.items
        assert item.duration_s == pytest.approx(2.0) and item.num_tokens == 50
        with TransportContext() as consumer:
            assert decode(item.embeddings, transport=consumer).shape == (50, 256)


def test_pcm16_samples_encode_as_the_same_float_samples(encoder):
    """A Converse turn's speech goes to the encoder as the client's PCM16 (int16 samples, inline): no WAV
    to write and decode again; it encodes as the same samples in float."""
    pcm = (np.sin(np.arange(24000) / 5) * 16000).astype("<i2")
    as_float = pcm.astype(np.float32) / 32768.0

    def embeddings(dtype: int, data: bytes) -> torch.Tensor:
        ref = tensor_pb2.TensorRef(dtype=dtype, shape=[pcm.size], inline_data=data)
        item = encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_AUDIO, samples=ref, sample_rate_hz=12000)
        (out,) = _stub(encoder).Encode(encoder_pb2.EncodeRequest(items=[item]), timeout=60).items
        with TransportContext() as consumer:
            return decode(out.embeddings, transport=consumer).clone()

    got = embeddings(tensor_pb2.DTYPE_INT16, pcm.tobytes())
    want = embeddings(tensor_pb2.DTYPE_FLOAT32, as_float.tobytes())
    assert got.shape == want.shape == (50, 256) and torch.allclose(got, want)


def test_concurrent_requests_are_batched_and_every_lease_returns(encoder):
    before = (
        _metric(encoder, "omnistage_encoder_batches_total", "vision"),
        _metric(encoder, "omnistage_encoder_batched_items_total", "vision"),
    )

    async def run() -> list[encoder_pb2.EncodeResponse]:
        async with grpc.aio.insecure_channel(encoder["address"]) as ch:
            stub = encoder_pb2_grpc.EncoderStub(ch)
            request = encoder_pb2.EncodeRequest(
                items=[encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_IMAGE, data=IMAGE)] * 4
            )
            return await asyncio.gather(*(stub.Encode(request, timeout=120) for _ in range(6)))

    responses = asyncio.run(run())
    after = (
        _metric(encoder, "omnistage_encoder_batches_total", "vision"),
        _metric(encoder, "omnistage_encoder_batched_items_total", "vision"),
    )
    batches, items = after[0] - before[0], after[1] - before[1]
    assert items == 24 and batches < items  # 24 images in fewer forwards than images
    assert batches >= 24 / 4  # never more than the stress-tested 4 per forward
    assert _metric_plain(encoder, "omnistage_encoder_leases_active") == 24  # held until the consumer decodes
    with TransportContext() as consumer:
        for r in responses:
            for item in r.items:
                decode(item.embeddings, transport=consumer)
    deadline = time.monotonic() + 10
    while _metric_plain(encoder, "omnistage_encoder_leases_active") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric_plain(encoder, "omnistage_encoder_leases_active") == 0
    assert _metric_plain(encoder, "omnistage_encoder_leased_bytes") == 0


def _metric_plain(encoder, name: str) -> float:
    text = urllib.request.urlopen(encoder["metrics"], timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on /metrics")


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        (
            encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_IMAGE, data=b"not an image"),
            "items[1] (image): not a supported image format",
        ),
        (
            encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_AUDIO, data=b"RIFF1234WAVEjunk"),
            "items[1] (audio)",
        ),
        (encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_UNSPECIFIED, data=b"x"), "items[1].kind"),
        (encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_IMAGE), "items[1]: set one of data"),
        (
            encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_VIDEO, frames=encoder_pb2.VideoFrames()),
            "items[1].frames.images: at least one frame",
        ),
        (
            encoder_pb2.EncodeItem(
                kind=encoder_pb2.MEDIA_KIND_IMAGE, frames=encoder_pb2.VideoFrames(images=[IMAGE])
            ),
            "items[1].frames: not accepted for a image item",
        ),
    ],
)
def test_a_bad_item_fails_the_rpc_naming_it(encoder, item, needle):
    good = encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_IMAGE, data=IMAGE)
    with pytest.raises(grpc.RpcError) as err:
        _stub(encoder).Encode(encoder_pb2.EncodeRequest(items=[good, item]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details(), err.value.details()
    # The service keeps serving.
    ok = _stub(encoder).Encode(encoder_pb2.EncodeRequest(items=[good]), timeout=30)
    with TransportContext() as consumer:
        decode(ok.items[0].embeddings, transport=consumer)


def test_too_many_items(encoder):
    item = encoder_pb2.EncodeItem(kind=encoder_pb2.MEDIA_KIND_IMAGE, data=IMAGE)
    with pytest.raises(grpc.RpcError) as err:
        _stub(encoder).Encode(encoder_pb2.EncodeRequest(items=[item] * 5), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items: 5 items exceed the limit of 4" in err.value.details()


def test_metrics_pass_promtool_check_metrics(encoder, check_metrics):
    """/metrics after this test's own traffic (an item of each kind, a refused request), whatever ran before
    it: the labelled series they count are there and pass promtool (tests/deploy checks the names)."""
    kinds = [
        (encoder_pb2.MEDIA_KIND_IMAGE, IMAGE),
        (encoder_pb2.MEDIA_KIND_AUDIO, AUDIO),
        (encoder_pb2.MEDIA_KIND_VIDEO, VIDEO),
    ]
    ok = _stub(encoder).Encode(
        encoder_pb2.EncodeRequest(
            items=[encoder_pb2.EncodeItem(kind=kind, data=data) for kind, data in kinds]
        ),
        timeout=60,
    )
    with TransportContext() as consumer:  # decoded: the leases come back
        for item in ok.items:
            decode(item.embeddings, transport=consumer)
    with pytest.raises(grpc.RpcError):
        _stub(encoder).Encode(
            encoder_pb2.EncodeRequest(items=[encoder_pb2.EncodeItem(data=b"x")]), timeout=30
        )
    text = exposition_with_codes(encoder["metrics"], "OK", "INVALID_ARGUMENT")
    batches = [line for line in text.splitlines() if line.startswith("omnistage_encoder_batches_total{")]
    for modality in ("vision", "audio"):  # the towers' forwards (images and video share the vision one)
        assert any(f'modality="{modality}"' in line for line in batches), batches
    check_metrics(text)
