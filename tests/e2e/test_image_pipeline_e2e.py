"""Image output end to end through `omnistage serve` on the tiny checkpoint: gateway → (encoder →)
thinker in hidden-state mode → shared memory → ImageGen, over real gRPC.

Omni.Generate with MODALITY_IMAGE streams a progress event per denoising step, then a PNG of the
requested size and one Finish; an edit sends the last user image (encoded for the thinker too) and
defaults to its size; a client cancel mid-denoise stops the DiT and leaves no request in ImageGen
(Describe, its active-requests gauge) and no hidden-state lease in the thinker's pool (its gauge);
bad options are INVALID_ARGUMENT naming the field, before any stage runs or relayed from ImageGen.
On the full tiny pipeline the e2e tests share (tests/e2e/full_pipeline.py; its image stage allows
1024 px and 50 steps, its encoder sends every item by shared memory).
"""

from __future__ import annotations

import io

import grpc
import pytest
from omnistage.common.runtime.auth import bearer
from omnistage.v1 import common_pb2, control_pb2, control_pb2_grpc, omni_pb2, omni_pb2_grpc
from PIL import Image

from tests.e2e.full_pipeline import KEY
from tests.e2e.serve_pipeline import metric
from tests.waits import wait_for

pytestmark = pytest.mark.timeout(300)


class ImagePath:
    """The image path of the full tiny pipeline the e2e tests share (tests/e2e/full_pipeline.py): its
    gateway (the API key presented on every call) and the stages' Describe and /metrics."""

    def __init__(self, shared: dict) -> None:
        ports = shared["ports"]
        self.gateway = shared["grpc"]
        self.auth = bearer(KEY)
        self.imagegen_admin = f"127.0.0.1:{ports['imagegen']['admin_port']}"
        self.imagegen_metrics = f"http://127.0.0.1:{ports['imagegen']['metrics_port']}/metrics"
        self.thinker_metrics = f"http://127.0.0.1:{ports['thinker']['metrics_port']}/metrics"
        self.encoder_metrics = f"http://127.0.0.1:{ports['encoder']['metrics_port']}/metrics"

    def generate(self, req: omni_pb2.GenerateRequest, timeout: float = 120) -> list[omni_pb2.GenerateEvent]:
        with grpc.insecure_channel(self.gateway) as ch:
            return list(omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=timeout, metadata=self.auth))

    def refused(self, req: omni_pb2.GenerateRequest) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            self.generate(req, timeout=60)
        return err.value

    def imagegen_busy(self) -> int:
        """Requests ImageGen holds (Describe), and those in its denoising loop (its gauge)."""
        with grpc.insecure_channel(self.imagegen_admin) as ch:
            desc = control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=5)
        active = metric(self.imagegen_metrics, "omnistage_imagegen_active_requests{")
        return desc.running_requests + desc.queued_requests + int(active)

    def hidden_state_leases(self) -> int:
        return int(metric(self.thinker_metrics, "omnistage_thinker_hidden_state_leases_active{"))

    def encoder_leases(self) -> int:
        return int(metric(self.encoder_metrics, "omnistage_encoder_leases_active{"))

    def wait_clean(self) -> None:
        """Every wait has a deadline: ImageGen idle, no hidden-state or embedding lease outstanding."""
        wait_for(lambda: self.imagegen_busy() == 0, 30, "ImageGen to hold no request", poll_s=0.1)
        wait_for(
            lambda: self.hidden_state_leases() == 0, 30, "the thinker's hidden-state leases back", poll_s=0.1
        )
        wait_for(lambda: self.encoder_leases() == 0, 30, "the encoder's leases back", poll_s=0.1)


@pytest.fixture(scope="module")
def pipeline(shared_pipeline):
    return ImagePath(shared_pipeline)


def _photo(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 40)).save(buf, format="JPEG")
    return buf.getvalue()


def request(
    *parts: omni_pb2.ContentPart, outputs=(omni_pb2.MODALITY_IMAGE,), request_id: str = "", **image
) -> omni_pb2.GenerateRequest:
    parts = parts or (omni_pb2.ContentPart(text="Draw a lighthouse on a cliff."),)
    return omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=list(parts))],
        output_modalities=list(outputs),
        image=omni_pb2.ImageOptions(**image),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    )


def kinds(events) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def test_progress_per_step_then_a_png_of_the_requested_size(pipeline):
    events = pipeline.generate(request(request_id="draw-1", width=192, height=128, steps=3, seed=7))
    assert kinds(events) == ["progress"] * 3 + ["image", "finish"]
    assert [(e.progress.stage, e.progress.done, e.progress.total) for e in events[:3]] == [
        ("imagegen", i, 3) for i in (1, 2, 3)
    ]
    image = events[3].image
    png = Image.open(io.BytesIO(image.png))
    assert png.format == "PNG" and png.size == (192, 128) == (image.width, image.height)
    finish = events[-1].finish
    assert (
        finish.reason == common_pb2.FINISH_REASON_STOP and finish.usage.prompt_tokens > 256
    )  # + the query block
    assert {e.request_id for e in events} == {"draw-1"}
    pipeline.wait_clean()


def test_text_and_image_stream_the_text_then_the_image(pipeline):
    events = pipeline.generate(
        request(outputs=(omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_IMAGE), width=64, height=64, steps=1)
    )
    k = kinds(events)
    assert k == ["text"] * k.count("text") + ["progress", "image", "finish"] and k.count("text") >= 1
    assert events[-1].finish.usage.completion_tokens == 4
    assert Image.open(io.BytesIO(events[-2].image.png)).size == (64, 64)
    pipeline.wait_clean()


def test_text_and_image_of_a_photo_encode_it_once_for_both_thinker_calls(pipeline):
    """The answer's thinker call leaves the photo's leases with the gateway, the image's call takes them:
    one Encode, no lease left anywhere."""
    encoded = metric(pipeline.encoder_metrics, "omnistage_encoder_items_total{", 0.0)
    parts = (
        omni_pb2.ContentPart(image=omni_pb2.Media(data=_photo(64, 64))),
        omni_pb2.ContentPart(text="Paint this."),
    )
    events = pipeline.generate(
        request(
            *parts, outputs=(omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_IMAGE), width=64, height=64, steps=1
        )
    )
    k = kinds(events)
    assert k == ["text"] * k.count("text") + ["progress", "image", "finish"] and k.count("text") >= 1
    assert metric(pipeline.encoder_metrics, "omnistage_encoder_items_total{") == encoded + 1
    pipeline.wait_clean()


def test_an_edit_of_the_last_user_image_defaults_to_its_size(pipeline):
    parts = (
        omni_pb2.ContentPart(text="Make the sky blue."),
        omni_pb2.ContentPart(image=omni_pb2.Media(data=_photo(200, 136))),
    )
    events = pipeline.generate(request(*parts, edit=True, steps=2, seed=3))
    assert kinds(events) == ["progress", "progress", "image", "finish"]
    png = Image.open(io.BytesIO(events[2].image.png))
    assert png.format == "PNG" and png.size == (
        208,
        144,
    )  # 200 x 136, each side to the nearest multiple of 16
    pipeline.wait_clean()


def test_a_client_cancel_mid_denoise_frees_the_dit_and_the_leases(pipeline):
    cancelled = metric(pipeline.imagegen_metrics, "omnistage_imagegen_cancelled_total{", 0.0)
    with grpc.insecure_channel(pipeline.gateway) as ch:
        call = omni_pb2_grpc.OmniStub(ch).Generate(
            request(width=512, height=512, steps=50, seed=1), timeout=120, metadata=pipeline.auth
        )
        seen = []
        for event in call:
            seen.append(event.WhichOneof("event"))
            if seen.count("progress") == 2:
                call.cancel()
                break
    assert seen == ["progress", "progress"]
    pipeline.wait_clean()
    wait_for(
        lambda: metric(pipeline.imagegen_metrics, "omnistage_imagegen_cancelled_total{", 0.0) > cancelled,
        30,
        "ImageGen to count the cancel",
        poll_s=0.1,
    )
    # ...and it keeps serving.
    assert kinds(pipeline.generate(request(width=64, height=64, steps=1)))[-2:] == ["image", "finish"]


@pytest.mark.parametrize(
    ("options", "details"),
    [
        ({"width": 100}, "image.width: 100 is not a multiple of 16"),
        ({"height": 2048}, "image.height: 2048 is outside [64, 1024] (the image stage's limits)"),
        ({"steps": 51}, "image.steps: 51 exceeds the image stage's limit of 50"),
        ({"guidance_scale": float("nan")}, "image.guidance_scale: must be a finite number >= 0, got nan"),
        ({"edit": True}, "image.edit: the last user message has no image part to edit"),
        # Within the gateway's limits; ImageGen refuses it, the field named as the client knows it.
        ({"width": 64, "height": 1024}, "imagegen: image.height / image.width: aspect ratio"),
    ],
)
def test_bad_options_are_invalid_argument_naming_the_field(pipeline, options, details):
    err = pipeline.refused(request(**{"steps": 1, **options}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(details), err.details()
    pipeline.wait_clean()
