"""`python -m omnistage.services.gateway --config F --service NAME`: the public Omni API.

Start-up waits for every deployed stage it calls (the thinker; the encoder, the talker and the image
stage when deployed) to be SERVING, sends one real text request through the thinker, one sentence
through the talker, with an encoder one request with an image through the whole media path (encoder →
shared memory → thinker), and with an image stage one image request (thinker hidden states → shared
memory → ImageGen, one step at the smallest size), then serves.
"""

from __future__ import annotations

import io
import sys

from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.runtime import auth
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_main import run_service
from omnistage.common.transport import TransportContext
from omnistage.services.gateway.converse import ConverseLimits
from omnistage.services.gateway.imaging import ImageLimits, ImageStage
from omnistage.services.gateway.media import MediaStage
from omnistage.services.gateway.prompt import Turn, build_chat
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.speech import SpeechLimits, SpeechStage
from omnistage.services.gateway.stages import EncoderClient, ImageGenClient, TalkerClient, ThinkerClient
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import common_pb2, control_pb2, omni_pb2, omni_pb2_grpc, talker_pb2


class _Deadline:
    """The one thing the servicer asks of a call context, for the start-up request."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def time_remaining(self) -> float:
        return self.seconds


def _warmup_image() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 140, 200)).save(buf, format="PNG")
    return buf.getvalue()


async def _warm_up_media(servicer: OmniServicer) -> None:
    """One image request through the path clients take: a broken shm hand-over fails start-up."""
    parts = [omni_pb2.ContentPart(image=omni_pb2.Media(data=_warmup_image())), omni_pb2.ContentPart(text="warm-up")]
    request = omni_pb2.GenerateRequest(
        request_id="gateway-warmup-media", messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=parts)],
        sampling=common_pb2.SamplingParams(max_tokens=1),
    )  # fmt: skip
    events = [e async for e in servicer.Generate(request, _Deadline(60.0))]
    if not events or events[-1].WhichOneof("event") != "finish":
        raise RuntimeError("the media warm-up request ended without a finish")


async def _warm_up_image(servicer: OmniServicer) -> None:
    """One image request through the path clients take (thinker hidden states → ImageGen): one step
    at the smallest size; a broken hand-over fails start-up."""
    side = servicer.images.limits.min_side_px
    request = omni_pb2.GenerateRequest(
        request_id="gateway-warmup-image", output_modalities=[omni_pb2.MODALITY_IMAGE],
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="warm-up")])],
        image=omni_pb2.ImageOptions(width=side, height=side, steps=1, seed=0),
    )  # fmt: skip
    events = [e async for e in servicer.Generate(request, _Deadline(120.0))]
    kinds = [e.WhichOneof("event") for e in events]
    if kinds[-2:] != ["image", "finish"]:
        raise RuntimeError(f"the image warm-up request ended with {kinds[-2:]}, not an image and a finish")


async def _image_stage(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig) -> ImageStage:
    """The image stage's client, once it is SERVING, with its Describe limits."""
    g = cfg.services_of("imagegen")[0]
    client = ImageGenClient(g.name, cfg.address(g.name), max(g.max_message_bytes, svc.max_message_bytes),
                            admin_address=cfg.admin_address(g.name), admin_metadata=auth.admin_metadata(g))
    runtime.reporter.heartbeat(f"waiting for {g.name}")
    try:
        await client.wait_serving(svc.gateway.stage_wait_s)
        desc = await client.describe()  # None without an admin port: the deploy file's limits then
    except Exception:
        await client.close()
        raise
    limits = ImageLimits.of(g.imagegen, desc.limits if desc is not None else None)
    # Releases only (hidden states that never reach ImageGen): the gateway maps no bytes of them. A
    # GPU image stage can open CUDA IPC handles, so hidden states made on a GPU may stay there.
    return ImageStage(client, TransportContext(), limits, allow_cuda_ipc=g.device == "cuda")


async def _warm_up_talker(talker: TalkerClient) -> None:
    """One sentence through Speak: the talker answers with speech before the gateway serves."""
    call = talker.speak(60.0)
    try:
        await call.write(talker_pb2.SpeakRequest(config=talker_pb2.SpeakConfig(request_id="gateway-warmup", seed=0)))
        await call.write(talker_pb2.SpeakRequest(text="Warm-up.", end_of_text=True))
        audio = False
        async for response in call:
            audio = audio or response.HasField("audio")
        if not audio:
            raise RuntimeError(f"{talker.name}: the warm-up sentence got no audio")
    finally:
        call.cancel()
        talker.ended()


async def _start_talker(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig) -> SpeechStage | None:
    """The talker's client once it is SERVING and spoke a warm-up sentence; None when degraded."""
    gw, t = svc.gateway, cfg.services_of("talker")[0]
    talker = TalkerClient(t.name, cfg.address(t.name), max(t.max_message_bytes, svc.max_message_bytes),
                          admin_address=cfg.admin_address(t.name), admin_metadata=auth.admin_metadata(t))
    runtime.reporter.heartbeat(f"waiting for {t.name}")
    try:
        await talker.wait_serving(gw.stage_wait_s)
        await talker.read_limits()  # the streams this gateway may hold open (Describe)
        await _warm_up_talker(talker)
    except Exception:
        await talker.close()
        if not gw.allow_degraded:
            raise
        runtime.reporter.heartbeat(f"{t.name} unavailable; serving without speech")
        return None
    runtime.add_shutdown_hook(talker.close)
    limits = SpeechLimits(t.talker.max_text_chars, gw.talker_start_wait_s, gw.talker_idle_timeout_s,
                          gw.speech_buffer_events)
    return SpeechStage(talker, limits, svc.name)


def _converse_limits(cfg: DeployConfig, svc: ServiceConfig) -> ConverseLimits:
    gw, encoders = svc.gateway, cfg.services_of("encoder")
    enc = encoders[0].encoder if encoders else None
    return ConverseLimits(gw.converse_max_turns, gw.converse_max_turn_chars, gw.converse_max_turn_audio_bytes,
                          enc.max_audio_seconds if enc else ConverseLimits.max_audio_seconds,
                          enc.max_items_per_request if enc else ConverseLimits.max_audio_items)


async def build(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> None:
    gw = svc.gateway
    deployed = {s.kind for s in cfg.services.values() if s.kind != "gateway"}
    thinker = None
    max_model_len: int | None = None
    thinkers = cfg.services_of("thinker")
    encoders = cfg.services_of("encoder")
    talkers = cfg.services_of("talker")
    imagegens = cfg.services_of("imagegen")
    if thinkers or encoders or talkers or imagegens:
        stages = len(thinkers[:1]) + len(encoders[:1]) + len(talkers[:1]) + len(imagegens[:1])
        runtime.reporter.enter("warming_up", total=stages, unit="stages")
    media = None
    if encoders:
        e = encoders[0]
        encoder = EncoderClient(e.name, cfg.address(e.name), max(e.max_message_bytes, svc.max_message_bytes),
                                admin_address=cfg.admin_address(e.name), admin_metadata=auth.admin_metadata(e))
        runtime.reporter.heartbeat(f"waiting for {e.name}")
        try:
            await encoder.wait_serving(gw.stage_wait_s)
            # Releases only (refs that never reach the thinker): the gateway maps no bytes of them.
            # A GPU thinker can open CUDA IPC handles, so embeddings made on a GPU may stay there.
            cuda_thinker = bool(thinkers) and thinkers[0].device == "cuda"
            media = MediaStage(encoder, TransportContext(), max_request_bytes=e.max_message_bytes,
                               allow_cuda_ipc=cuda_thinker)
            runtime.add_shutdown_hook(media.close)
        except Exception:
            await encoder.close()
            if not gw.allow_degraded:
                raise
            runtime.reporter.heartbeat(f"{e.name} unavailable; serving degraded")
            deployed.discard("encoder")
        runtime.reporter.advance()
    if thinkers:
        t = thinkers[0]
        client = ThinkerClient(t.name, cfg.address(t.name), max(t.max_message_bytes, svc.max_message_bytes),
                               admin_address=cfg.admin_address(t.name), admin_metadata=auth.admin_metadata(t))
        runtime.reporter.heartbeat(f"waiting for {t.name}")
        try:
            await client.wait_serving(gw.stage_wait_s)
            desc = await client.describe()  # None without an admin port: then only the thinker checks lengths
            max_model_len = (desc.limits.max_model_len or None) if desc is not None else None
            # A real request end to end before SERVING: the path the clients will take works.
            warmup = build_chat([Turn("user", "warm-up")])
            async for _ in client.generate("gateway-warmup", warmup, common_pb2.SamplingParams(max_tokens=1), 60.0):
                pass
            thinker = client
        except Exception:
            if not gw.allow_degraded:
                raise
            runtime.reporter.heartbeat(f"{t.name} unavailable; serving degraded")
            deployed.discard("thinker")
        runtime.reporter.advance()
    speech = None
    if talkers:
        speech = await _start_talker(runtime, cfg, svc)
        if speech is None:
            deployed.discard("talker")
        runtime.reporter.advance()
    images = None
    if imagegens:
        try:
            images = await _image_stage(runtime, cfg, svc)
            runtime.add_shutdown_hook(images.close)
        except Exception:
            if not gw.allow_degraded:
                raise
            runtime.reporter.heartbeat(f"{imagegens[0].name} unavailable; serving degraded")
            deployed.discard("imagegen")
        runtime.reporter.advance()
    servicer = OmniServicer(
        thinker,
        deployed,
        max_concurrent_requests=gw.max_concurrent_requests,
        limits=RequestLimits(gw.max_messages, gw.max_parts_per_message, gw.max_prompt_chars, max_model_len),
        system_prompt=gw.system_prompt,
        media_dir=gw.media_dir,
        media=media,
        speech=speech,
        images=images,
        converse=_converse_limits(cfg, svc),
    )
    if media is not None and thinker is not None:
        runtime.reporter.heartbeat("one image through encoder and thinker")
        try:
            await _warm_up_media(servicer)
        except Exception:
            if not gw.allow_degraded:
                raise
            runtime.reporter.heartbeat("the media path failed its warm-up; serving without media")
            servicer.media = None
            deployed.discard("encoder")
    if images is not None and thinker is not None:
        runtime.reporter.heartbeat("one image through thinker and image stage")
        try:
            await _warm_up_image(servicer)
        except Exception:
            if not gw.allow_degraded:
                raise
            runtime.reporter.heartbeat("the image path failed its warm-up; serving without image output")
            servicer.images = None
            deployed.discard("imagegen")
    runtime.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, servicer, "omnistage.v1.Omni")
    runtime.set_limits_provider(
        lambda: control_pb2.Limits(
            max_running_requests=gw.max_concurrent_requests, max_message_bytes=svc.max_message_bytes
        )
    )
    runtime.set_load_provider(lambda: (servicer.in_flight, 0))
    if thinker is not None:
        runtime.add_shutdown_hook(thinker.close)
    runtime.set_serving()


def main() -> None:
    run_service(sys.argv[1:], "gateway", build)


if __name__ == "__main__":
    main()
