"""Image output through the gateway with fake stages: the thinker's hidden-state ref goes to ImageGen
(a real gRPC fake) unchanged, one progress event per denoising step then the PNG, text before the
image when both are asked for; options refused with the field named before any stage runs; a cancel
stops ImageGen (its stream is cancelled) or the thinker (its stream is closed); ImageGen down or
refusing is named; no hidden-state lease is left behind."""

from __future__ import annotations

import asyncio
import io
import time

import grpc
import pytest
import torch
from omnistage.common.config import config_from_dict
from omnistage.common.runtime.errors import InvalidRequest, OmniError, Overloaded, StageUnavailable
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.transport import TransportContext, TransportOptions, decode, encode
from omnistage.services.gateway.media import MediaStage
from omnistage.services.gateway.outputs.image_options import ImageLimits, edit_size
from omnistage.services.gateway.outputs.imagegen import ImageStage
from omnistage.services.gateway.outputs.talker import SpeechLimits, SpeechStage
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.stages import ImageGenClient, TalkerClient
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import common_pb2, encoder_pb2, imagegen_pb2, imagegen_pb2_grpc, omni_pb2, thinker_pb2
from PIL import Image
from prometheus_client import REGISTRY

from tests.common.runtime.synthetic_stage import free_port
from tests.services.gateway.gateway_speech_fakes import FakeTalker, TalkerServer
from tests.services.gateway.leftovers import Leftovers
from tests.waits import wait_for_async

QUERIES, HIDDEN = 256, 64
LIMITS = ImageLimits(
    min_side_px=64, max_side_px=1024, max_steps=50, max_guidance_scale=20.0, max_batch=2, max_queued=2
)


@pytest.fixture
def producer():
    """The thinker's producer pool, in this process."""
    with TransportContext(TransportOptions(shm_pool_bytes=8 << 20)) as ctx:
        yield ctx


def leases(producer: TransportContext) -> int:
    pool = producer.shm_pool()
    pool.arena.reclaim()
    return pool.arena.active_leases


def png(width: int, height: int, color=(200, 40, 40), fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format=fmt)
    return buf.getvalue()


class FakeThinker:
    """Text: two deltas and a finish. Hidden-state mode: (after `delay_s`) one hidden-state ref in
    `producer`'s shm pool, then a finish. Remembers the calls and how many streams were closed early."""

    def __init__(self, producer: TransportContext, delay_s: float = 0.0) -> None:
        self.producer, self.delay_s = producer, delay_s
        self.calls: list[tuple[str, thinker_pb2.HiddenStatesRequest | None, list]] = []
        self.closed_early = 0
        self.refs: list = []

    async def generate(self, request_id, prompt, sampling, timeout_s, multimodal=None, hidden_states=None):
        self.calls.append(
            ("hidden" if hidden_states is not None else "text", hidden_states, list(multimodal or []))
        )
        done = False
        try:
            yield thinker_pb2.ThinkerEvent(started=thinker_pb2.Started(engine_request_id="e" * 32))
            if hidden_states is None:
                for text in ("An ", "answer"):
                    yield thinker_pb2.ThinkerEvent(delta=thinker_pb2.TokenDelta(text=text, token_ids=[1]))
                usage = common_pb2.Usage(prompt_tokens=20, completion_tokens=2)
                yield thinker_pb2.ThinkerEvent(
                    finish=thinker_pb2.ThinkerFinish(reason=common_pb2.FINISH_REASON_STOP, usage=usage)
                )
            else:
                await asyncio.sleep(self.delay_s)
                ref = encode(
                    torch.randn(QUERIES, HIDDEN).to(torch.bfloat16), transport=self.producer, force="shm"
                )
                self.refs.append(ref)
                yield thinker_pb2.ThinkerEvent(hidden_states=thinker_pb2.HiddenStates(tensor=ref))
                usage = common_pb2.Usage(prompt_tokens=278, completion_tokens=0)
                yield thinker_pb2.ThinkerEvent(
                    finish=thinker_pb2.ThinkerFinish(reason=common_pb2.FINISH_REASON_STOP, usage=usage)
                )
            done = True
        finally:
            self.closed_early += not done


class FakeImageGen(imagegen_pb2_grpc.ImageGenServicer):
    """Copies the conditioning (its lease ends), then a progress event per step `step_s` apart and a PNG
    of the requested size; or refuses with `refuse` before reading the conditioning."""

    def __init__(self, step_s: float = 0.01, refuse: str = "") -> None:
        self.step_s, self.refuse = step_s, refuse
        self.requests: list[imagegen_pb2.ImageGenRequest] = []
        self.conditions: list[torch.Tensor] = []
        self.steps_run = 0
        self.cancelled = 0
        self.transport = TransportContext()

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.refuse:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse)
        self.conditions.append(decode(request.condition, transport=self.transport))
        steps = request.steps if request.HasField("steps") else 30
        try:
            for step in range(1, steps + 1):
                await asyncio.sleep(self.step_s)
                self.steps_run += 1
                yield imagegen_pb2.ImageGenEvent(
                    progress=imagegen_pb2.ImageGenProgress(step=step, total_steps=steps)
                )
            w, h = request.width or 512, request.height or 512
            yield imagegen_pb2.ImageGenEvent(
                image=imagegen_pb2.ImageGenImage(png=png(w, h), width=w, height=h)
            )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


class Context:
    def __init__(self) -> None:
        self.deadlines: list = []

    def time_remaining(self):
        return 30.0


class FakeEncoder:
    """One image item per part (a 2 x 2 grid), rows in `pool`."""

    def __init__(self, pool: TransportContext) -> None:
        self.pool, self.calls = pool, 0

    async def encode(self, request, timeout_s):
        self.calls += 1
        items = [
            encoder_pb2.EncodedItem(
                kind=1,
                embeddings=encode(torch.randn(4, HIDDEN), transport=self.pool, force="shm"),
                num_tokens=4,
                placeholder_token_id=7,
                merged_grids=[encoder_pb2.GridTHW(t=1, h=2, w=2)],
            )
            for _ in request.items
        ]
        return encoder_pb2.EncodeResponse(items=items)


def request(
    *parts: omni_pb2.ContentPart, outputs=(omni_pb2.MODALITY_IMAGE,), **image
) -> omni_pb2.GenerateRequest:
    parts = parts or (omni_pb2.ContentPart(text="Draw a lighthouse"),)
    return omni_pb2.GenerateRequest(
        request_id="img-1",
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=list(parts))],
        output_modalities=list(outputs),
        image=omni_pb2.ImageOptions(**image),
    )


class Gateway:
    """OmniServicer over a fake thinker and a real ImageGenClient to a fake ImageGen gRPC service, built
    as the gateway builds it: `speech` for a talker, `with_images=False` for an image stage that is
    deployed but was not reachable when the gateway started."""

    def __init__(
        self,
        thinker: FakeThinker,
        imagegen: FakeImageGen | None,
        tmp_path,
        encoder=None,
        deployed=("thinker", "imagegen", "encoder"),
        speech: SpeechStage | None = None,
        with_images: bool = True,
    ) -> None:
        self.thinker, self.imagegen, self.tmp_path = thinker, imagegen, tmp_path
        self.encoder, self.deployed, self.speech, self.with_images = (
            encoder,
            set(deployed),
            speech,
            with_images,
        )

    async def __aenter__(self) -> Gateway:
        name = "fake_imagegen"
        cfg = config_from_dict({"services": {name: {"kind": "imagegen", "port": free_port()}}})
        self.runtime = ServiceRuntime(cfg, cfg.service(name), 0, run_dir=self.tmp_path)
        await self.runtime.start()
        if self.imagegen is not None:
            self.runtime.add_servicer(
                imagegen_pb2_grpc.add_ImageGenServicer_to_server, self.imagegen, "omnistage.v1.ImageGen"
            )
            self.runtime.set_serving()
        else:  # ImageGen is down: nothing listens where the gateway dials
            self.runtime.request_stop()
            await asyncio.wait_for(self.runtime.serve_until_stopped(), 10)
        self.client = ImageGenClient(name, cfg.address(name), 4 << 20)
        self.release_ctx = TransportContext()
        self.images = ImageStage(self.client, self.release_ctx, LIMITS)
        media = None
        if self.encoder is not None:
            media = MediaStage(self.encoder, TransportContext(), max_request_bytes=1 << 20)
        self.servicer = OmniServicer(
            Pipeline(
                self.thinker,
                self.deployed,
                max_concurrent_requests=8,
                limits=RequestLimits(),
                system_prompt="",
                images=self.images if self.with_images else None,
                media=media,
                speech=self.speech,
            )
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.images.close()
        if self.imagegen is not None:
            self.runtime.request_stop()
            await asyncio.wait_for(self.runtime.serve_until_stopped(), 10)

    @staticmethod
    def admitted(stage: str, what: str = "running") -> float:
        """The gateway's admission gauge of `stage` on /metrics: requests holding (`running`) or awaiting
        (`waiting`) one of its slots."""
        return REGISTRY.get_sample_value(
            f"omnistage_gateway_admission_{what}", {"service": "gateway", "stage": stage}
        )

    async def events(self, req: omni_pb2.GenerateRequest, stop_after: str = "", n: int = 0) -> list:
        """The client's events; `stop_after` an event kind seen `n` times: the client leaves there."""
        out = []
        gen = self.servicer.Generate(req, Context())
        try:
            async for event in gen:
                out.append(event)
                if stop_after and [e.WhichOneof("event") for e in out].count(stop_after) == n:
                    break
        finally:
            await gen.aclose()
        return out


def kinds(events) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def run(coro):
    return asyncio.run(coro)


def test_image_only_streams_progress_per_step_then_the_png(tmp_path, producer):
    async def scenario():
        thinker, imagegen = FakeThinker(producer), FakeImageGen()
        async with Gateway(thinker, imagegen, tmp_path) as gw:
            events = await gw.events(request(width=320, height=192, steps=5, seed=9))
            assert kinds(events) == ["progress"] * 5 + ["image", "finish"]
            assert [(e.progress.stage, e.progress.done, e.progress.total) for e in events[:5]] == [
                ("imagegen", i, 5) for i in range(1, 6)
            ]
            image = events[5].image
            assert (image.width, image.height) == (320, 192) and Image.open(io.BytesIO(image.png)).size == (
                320,
                192,
            )
            finish = events[-1].finish
            assert finish.reason == common_pb2.FINISH_REASON_STOP and finish.usage.prompt_tokens == 278
            assert {e.request_id for e in events} == {"img-1"}
            (call,) = thinker.calls  # no text call: the image alone was asked for
            assert call[0] == "hidden" and not call[1].allow_cuda_ipc
            (sent,) = imagegen.requests
            assert sent.condition.shm.lease_id == thinker.refs[0].shm.lease_id  # forwarded as it came
            assert (sent.width, sent.height, sent.steps, sent.seed) == (320, 192, 5, 9)
            assert not sent.HasField("guidance_scale") and sent.reference_image == b""
            assert sent.prompt_text == "Draw a lighthouse"
            defaults = await gw.events(request())  # 0s and unset: the stage's defaults
            assert kinds(defaults)[-2:] == ["image", "finish"] and kinds(defaults).count("progress") == 30
            assert (imagegen.requests[1].width, imagegen.requests[1].HasField("steps")) == (0, False)
            assert leases(producer) == 0  # ImageGen copied both conditionings

    run(scenario())


def test_text_and_image_stream_the_text_first_then_the_image_and_one_finish(tmp_path, producer):
    async def scenario():
        thinker = FakeThinker(producer)
        async with Gateway(thinker, FakeImageGen(), tmp_path) as gw:
            events = await gw.events(
                request(outputs=(omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_IMAGE), steps=2)
            )
            assert kinds(events) == ["text", "text", "progress", "progress", "image", "finish"]
            assert [c[0] for c in thinker.calls] == ["text", "hidden"]
            usage = events[-1].finish.usage
            assert (usage.prompt_tokens, usage.completion_tokens) == (20 + 278, 2)
            assert leases(producer) == 0

    run(scenario())


def test_speech_and_image_stream_the_spoken_answer_then_the_image_and_one_finish(tmp_path, producer):
    async def scenario():
        thinker = FakeThinker(producer)
        async with TalkerServer(FakeTalker()) as talker:
            client = TalkerClient("talker", talker.address, 1 << 22)
            speech = SpeechStage(client, SpeechLimits(start_wait_s=5.0, idle_timeout_s=5.0), "gw-test")
            outputs = (omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO, omni_pb2.MODALITY_IMAGE)
            try:
                async with Gateway(
                    thinker,
                    FakeImageGen(),
                    tmp_path,
                    speech=speech,
                    deployed=("thinker", "imagegen", "encoder", "talker"),
                ) as gw:
                    events = await gw.events(request(outputs=outputs, steps=2))
            finally:
                await client.close()
            k = kinds(events)
            assert k[-4:] == ["progress", "progress", "image", "finish"] and k.count("finish") == 1
            assert (
                set(k[:-4]) == {"text", "audio"} and events[-5].audio.last
            )  # the speech ends before the image
            assert [c[0] for c in thinker.calls] == ["text", "hidden"]
            finish = events[-1].finish
            assert finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE  # the speech's status is kept
            assert (finish.usage.prompt_tokens, finish.usage.completion_tokens) == (20 + 278, 2)
            assert leases(producer) == 0

    run(scenario())


def test_an_edit_sends_the_last_user_image_as_the_reference_and_defaults_to_its_size(tmp_path, producer):
    async def scenario():
        thinker, imagegen = FakeThinker(producer), FakeImageGen()
        with TransportContext(TransportOptions(shm_pool_bytes=1 << 20)) as encoder_pool:
            encoder = FakeEncoder(encoder_pool)
            photo = png(300, 200, fmt="JPEG")
            parts = (
                omni_pb2.ContentPart(image=omni_pb2.Media(data=png(64, 64))),
                omni_pb2.ContentPart(text="Make it blue"),
                omni_pb2.ContentPart(image=omni_pb2.Media(data=photo)),
            )
            async with Gateway(thinker, imagegen, tmp_path, encoder=encoder) as gw:
                events = await gw.events(request(*parts, edit=True, steps=1))
                assert kinds(events) == ["progress", "image", "finish"]
                (sent,) = imagegen.requests
                assert sent.reference_image == photo and (sent.width, sent.height) == (304, 208)
                ((mode, _, multimodal),) = thinker.calls
                assert mode == "hidden" and len(multimodal) == 2  # both images are ordinary inputs too
                assert (events[1].image.width, events[1].image.height) == (304, 208)
                events = await gw.events(request(*parts, edit=True, steps=1, width=128))
                assert (imagegen.requests[1].width, imagegen.requests[1].height) == (128, 208)

    assert leases(producer) == 0

    run(scenario())


def test_edit_size_fits_the_limits():
    assert edit_size(300, 200, LIMITS) == (304, 208)
    assert edit_size(4000, 1000, LIMITS) == (1024, 256)  # scaled down to the largest side allowed
    assert edit_size(20, 30, LIMITS) == (64, 64)  # up to the smallest side allowed


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"width": 100}, "image.width: 100 is not a multiple of 16"),
        ({"height": 2048}, "image.height: 2048 is outside [64, 1024] (the image stage's limits)"),
        ({"width": 32}, "image.width: 32 is outside [64, 1024] (the image stage's limits)"),
        ({"steps": 51}, "image.steps: 51 exceeds the image stage's limit of 50"),
        ({"guidance_scale": float("nan")}, "image.guidance_scale: must be a finite number >= 0, got nan"),
        ({"guidance_scale": -1.0}, "image.guidance_scale: must be a finite number >= 0, got -1"),
        ({"guidance_scale": 25.0}, "image.guidance_scale: 25 exceeds the image stage's limit of 20"),
        ({"edit": True}, "image.edit: the last user message has no image part to edit"),
    ],
)
def test_bad_options_are_named_before_any_stage_runs(tmp_path, producer, options, needle):
    async def scenario():
        thinker, imagegen = FakeThinker(producer), FakeImageGen()
        async with Gateway(thinker, imagegen, tmp_path) as gw:
            with pytest.raises(InvalidRequest) as err:
                await gw.events(request(**options))
            assert str(err.value) == needle
            assert not thinker.calls and not imagegen.requests

    run(scenario())


def test_image_output_needs_the_image_stage(tmp_path, producer):
    async def scenario():
        async with Gateway(FakeThinker(producer), FakeImageGen(), tmp_path, deployed=("thinker",)) as gw:
            with pytest.raises(StageUnavailable) as err:
                await gw.events(request())
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert (
                str(err.value)
                == "output_modalities: MODALITY_IMAGE needs the 'imagegen' stage, which is not deployed"
            )
        # Deployed, but the gateway started degraded without it.
        async with Gateway(
            FakeThinker(producer),
            FakeImageGen(),
            tmp_path,
            deployed=("thinker", "imagegen"),
            with_images=False,
        ) as gw:
            with pytest.raises(StageUnavailable, match="'imagegen' stage, which is not available") as err:
                await gw.events(request())
            assert err.value.code == grpc.StatusCode.UNAVAILABLE

    run(scenario())


def test_imagegen_down_is_unavailable_naming_it_and_the_condition_is_released(tmp_path, producer):
    async def scenario():
        thinker = FakeThinker(producer)
        async with Gateway(thinker, None, tmp_path) as gw:
            with pytest.raises(OmniError) as err:
                await gw.events(request(steps=2))
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and str(err.value).startswith("imagegen: ")
            assert (
                len(thinker.refs) == 1 and leases(producer) == 0
            )  # never forwarded: released by the gateway

    run(scenario())


def test_an_imagegen_refusal_names_the_clients_field_and_the_condition_is_released(tmp_path, producer):
    async def scenario():
        imagegen = FakeImageGen(refuse="height / width: aspect ratio 1024/64 = 16 is outside [0.25, 4.0]")
        async with Gateway(FakeThinker(producer), imagegen, tmp_path) as gw:
            with pytest.raises(OmniError) as err:
                await gw.events(request(width=64, height=1024))
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                str(err.value)
                == "imagegen: image.height / image.width: aspect ratio 1024/64 = 16 is outside [0.25, 4.0]"
            )
            assert leases(producer) == 0  # the fake refused without reading it: the gateway released it

    run(scenario())


def test_a_cancel_mid_denoise_cancels_the_imagegen_stream(tmp_path, producer):
    async def scenario():
        thinker, imagegen = FakeThinker(producer), FakeImageGen(step_s=0.05)
        async with Gateway(thinker, imagegen, tmp_path) as gw:
            events = await gw.events(request(steps=40), stop_after="progress", n=2)
            assert kinds(events) == ["progress", "progress"]
            await wait_for_async(lambda: imagegen.cancelled == 1, 5, "ImageGen to see the cancel")
            steps = imagegen.steps_run
            assert steps < 10
            await asyncio.sleep(0.2)
            assert imagegen.steps_run == steps  # nothing runs on
            assert gw.admitted("imagegen") == 0 and gw.admitted("thinker") == 0  # every slot came back
            assert leases(producer) == 0

    run(scenario())


def test_a_cancel_during_the_thinker_closes_its_stream_and_calls_no_imagegen(tmp_path, producer):
    async def scenario():
        thinker, imagegen = FakeThinker(producer, delay_s=5.0), FakeImageGen()
        async with Gateway(thinker, imagegen, tmp_path) as gw:
            task = asyncio.ensure_future(gw.events(request(steps=2)))
            await wait_for_async(lambda: thinker.calls, 5, "the thinker call")
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (
                thinker.closed_early == 1 and not imagegen.requests
            )  # the thinker stream closed (aborts there)
            assert (
                gw.admitted("imagegen") == 0
                and gw.admitted("imagegen", "waiting") == 0
                and leases(producer) == 0
            )

    run(scenario())


def test_image_requests_beyond_what_the_stage_takes_are_refused_before_the_thinker(tmp_path, producer):
    async def scenario():
        thinker = FakeThinker(producer)
        async with Gateway(thinker, FakeImageGen(step_s=0.05), tmp_path) as gw:
            # Every denoising slot taken and the waiting room full, by clients' requests.
            held = [
                asyncio.ensure_future(gw.events(request(steps=40)))
                for _ in range(LIMITS.max_batch + LIMITS.max_queued)
            ]
            try:
                await wait_for_async(
                    lambda: (
                        (gw.admitted("imagegen"), gw.admitted("imagegen", "waiting"))
                        == (LIMITS.max_batch, LIMITS.max_queued)
                    ),
                    10,
                    "the image stage to fill up",
                )
                calls = len(thinker.calls)
                with pytest.raises(
                    Overloaded,
                    match=r"^imagegen: 2 requests waiting, the most that may wait for it \(2 running of 2\)",
                ) as err:
                    await gw.events(request())  # refused at arrival, before the thinker runs
                assert err.value.reason == "imagegen_queue_full"
                assert len(thinker.calls) == calls
            finally:
                for task in held:
                    task.cancel()
                await asyncio.gather(*held, return_exceptions=True)

    run(scenario())


class LeaseTakingThinker(FakeThinker):
    """Ends the lease of every media item it takes, unless the caller keeps it (as the thinker does)."""

    def __init__(self, producer: TransportContext) -> None:
        super().__init__(producer)
        self.consumer = TransportContext()

    async def generate(self, request_id, prompt, sampling, timeout_s, multimodal=None, hidden_states=None):
        for item in multimodal or []:
            if not item.caller_keeps_lease:
                self.consumer.release(item.embeddings)
        async for event in super().generate(
            request_id, prompt, sampling, timeout_s, multimodal, hidden_states
        ):
            yield event


class ExpiringEncoder(FakeEncoder):
    """Its leases run out within the gateway's margin: a second thinker call must not get them."""

    async def encode(self, request, timeout_s):
        response = await super().encode(request, timeout_s)
        for item in response.items:
            item.embeddings.shm.lease_expiry_unix_ms = int(time.time() * 1000) + 100
        return response


def _text_and_image_with_a_photo() -> omni_pb2.GenerateRequest:
    parts = (
        omni_pb2.ContentPart(image=omni_pb2.Media(data=png(64, 64))),
        omni_pb2.ContentPart(text="Paint this"),
    )
    return request(*parts, outputs=(omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_IMAGE), steps=1)


def _text_and_image(tmp_path, producer, encoder_cls=FakeEncoder, **stop):
    """A text+image request with a photo through the gateway: (events, thinker calls, Encode calls, encoder
    leases left); `stop`: where the client leaves (Gateway.events)."""

    async def scenario():
        thinker = LeaseTakingThinker(producer)
        with TransportContext(TransportOptions(shm_pool_bytes=1 << 20)) as encoder_pool:
            encoder = encoder_cls(encoder_pool)
            async with Gateway(thinker, FakeImageGen(), tmp_path, encoder=encoder) as gw:
                events = await gw.events(_text_and_image_with_a_photo(), **stop)
            return events, thinker.calls, encoder.calls, leases(encoder_pool)

    return run(scenario())


def test_text_and_image_encode_the_media_once_and_the_image_call_takes_the_leases(tmp_path, producer):
    events, calls, encodes, left = _text_and_image(tmp_path, producer)
    assert kinds(events) == ["text", "text", "progress", "image", "finish"]
    assert encodes == 1  # one Encode for both thinker calls
    (text_mode, _, first), (hidden_mode, _, second) = calls
    assert (text_mode, hidden_mode) == ("text", "hidden")
    assert [m.caller_keeps_lease for m in first] == [True]  # the answer leaves the lease to the gateway
    assert [m.caller_keeps_lease for m in second] == [False]  # the image's call takes it over
    assert first[0].embeddings.shm.lease_id == second[0].embeddings.shm.lease_id
    assert left == 0 and leases(producer) == 0


def test_a_client_gone_during_the_text_leaves_no_media_lease_the_gateway_kept(tmp_path, producer):
    events, calls, encodes, left = _text_and_image(tmp_path, producer, stop_after="text", n=1)
    # The request's run goes on ahead of its client by its buffer (speech_buffer_events): the image's
    # call may have begun before the client left; either way no lease is left behind.
    assert kinds(events) == ["text"] and calls[0][0] == "text"
    assert encodes == 1 and left == 0  # released by the gateway, which kept it (or by the thinker)


def test_leases_that_would_expire_before_the_image_call_are_encoded_again(tmp_path, producer):
    events, calls, encodes, left = _text_and_image(tmp_path, producer, ExpiringEncoder)
    assert kinds(events)[-2:] == ["image", "finish"]
    assert encodes == 2  # the answer's leases were about to run out
    (_, _, first), (_, _, second) = calls
    assert first[0].embeddings.shm.lease_id != second[0].embeddings.shm.lease_id
    assert not second[0].caller_keeps_lease
    assert left == 0  # the first encoding released by the gateway, the second taken by the thinker


def test_image_calls_end_with_their_request_and_leave_nothing_to_the_gc(tmp_path, producer):
    """A finished image and one whose client leaves mid-denoise: each ImageGen stream is ended by the
    request (its own end taken, or cancelled), none by asyncio's finalizer closing a gateway generator
    later in a task of its own."""

    async def scenario():
        left = Leftovers()
        thinker, imagegen = FakeThinker(producer), FakeImageGen()
        async with Gateway(thinker, imagegen, tmp_path) as gw:
            done = await gw.events(request(steps=3))
            gone = await gw.events(request(steps=40), stop_after="progress", n=2)
            await wait_for_async(lambda: imagegen.cancelled == 1, 5, "ImageGen to see the cancel")
        return done, gone, await left.collected()

    done, gone, reports = run(scenario())
    assert kinds(done)[-2:] == ["image", "finish"] and kinds(gone) == ["progress", "progress"]
    assert reports == []
