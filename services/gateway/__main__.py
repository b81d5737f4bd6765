"""`python -m omnistage.services.gateway --config F --service NAME`: the public Omni API.

Start-up waits for every deployed stage it calls (the thinker; the encoder and the talker when
deployed) to be SERVING, sends one real text request through the thinker, one sentence through the
talker and, with an encoder, one request with an image through the whole media path (encoder →
shared memory → thinker), then serves.
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
from omnistage.services.gateway.media import MediaStage
from omnistage.services.gateway.prompt import Turn, build_chat
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.speech import SpeechLimits, SpeechStage
from omnistage.services.gateway.stages import EncoderClient, TalkerClient, ThinkerClient
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
    if thinkers or encoders or talkers:
        runtime.reporter.enter("warming_up", total=len(thinkers[:1]) + len(encoders[:1]) + len(talkers[:1]),
                               unit="stages")
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
    servicer = OmniServicer(
        thinker,
        deployed,
        max_concurrent_requests=gw.max_concurrent_requests,
        limits=RequestLimits(gw.max_messages, gw.max_parts_per_message, gw.max_prompt_chars, max_model_len),
        system_prompt=gw.system_prompt,
        media_dir=gw.media_dir,
        media=media,
        speech=speech,
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
    runtime.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, servicer, "omnistage.v1.Omni")
    runtime.set_limits_provider(
        lambda: control_pb2.Limits(
            max_running_requests=gw.max_concurrent_requests, max_message_bytes=svc.max_message_bytes
        )
    )
    runtime.set_load_provider(lambda: (servicer.in_flight, 0))
    if thinker is not None:
        runtime.add_shutdown_hook(thinker.close)
    if gw.http_port:
        await _start_http_front(runtime, cfg, svc)
    runtime.set_serving()


async def _start_http_front(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig) -> None:
    """The OpenAI-compatible HTTP front (gateway.http_port), calling this gateway's own Omni port."""
    from omnistage.services.gateway.openai.serve import HttpFront

    front = HttpFront(cfg, svc, runtime.port)
    await front.start()
    runtime.add_shutdown_hook(front.stop)


def main() -> None:
    run_service(sys.argv[1:], "gateway", build)


if __name__ == "__main__":
    main()
