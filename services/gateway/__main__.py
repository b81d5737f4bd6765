"""`python -m omnistage.services.gateway --config F --service NAME`: the public Omni API."""

from __future__ import annotations

import asyncio
import functools
import io
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from omnistage.common.config import ConfigError, DeployConfig, ServiceConfig
from omnistage.common.log import get_logger
from omnistage.common.memory.report import export_host_memory
from omnistage.common.runtime import auth
from omnistage.common.runtime.errors import StageUnavailable
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_main import run_service
from omnistage.common.stages import CAPABILITIES, MODEL_KINDS
from omnistage.common.transport import TransportContext
from omnistage.services.gateway.admission import GateConfig, StageGate
from omnistage.services.gateway.converse import ConverseLimits
from omnistage.services.gateway.imaging import ImageLimits, ImageStage
from omnistage.services.gateway.media import MESSAGE_OVERHEAD, MediaStage
from omnistage.services.gateway.pace import StepPace
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.prompt import Turn, build_chat
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.speech import SpeechLimits, SpeechStage
from omnistage.services.gateway.stage_watch import StageWatch
from omnistage.services.gateway.stages import (
    EncoderClient,
    ImageGenClient,
    StageClient,
    TalkerClient,
    ThinkerClient,
)
from omnistage.services.gateway.validation import RequestLimits, public_receive_bytes, wire_bounds
from omnistage.v1 import common_pb2, control_pb2, omni_pb2, omni_pb2_grpc, talker_pb2

C = TypeVar("C", bound=StageClient)


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
    parts = [
        omni_pb2.ContentPart(image=omni_pb2.Media(data=_warmup_image())),
        omni_pb2.ContentPart(text="warm-up"),
    ]
    request = omni_pb2.GenerateRequest(
        request_id="gateway-warmup-media",
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=parts)],
        sampling=common_pb2.SamplingParams(max_tokens=1),
    )
    events = [e async for e in servicer.Generate(request, _Deadline(60.0))]
    if not events or events[-1].WhichOneof("event") != "finish":
        raise RuntimeError("the media warm-up request ended without a finish")


async def _warm_up_image(servicer: OmniServicer, replica: ImageGenClient) -> None:
    """One image request through the path clients take (thinker hidden states → ImageGen `replica`): one
    step at the smallest size; a broken hand-over fails start-up."""
    images = servicer.pipeline.images
    side = images.limits.min_side_px
    request = omni_pb2.GenerateRequest(
        request_id=f"gateway-warmup-image-{replica.name}",
        output_modalities=[omni_pb2.MODALITY_IMAGE],
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="warm-up")])
        ],
        image=omni_pb2.ImageOptions(width=side, height=side, steps=1, seed=0),
    )
    with images.pinned(request.request_id, replica):
        events = [e async for e in servicer.Generate(request, _Deadline(120.0))]
    kinds = [e.WhichOneof("event") for e in events]
    if kinds[-2:] != ["image", "finish"]:
        raise RuntimeError(f"the image warm-up request ended with {kinds[-2:]}, not an image and a finish")


def _clients(cfg: DeployConfig, svc: ServiceConfig, kind: str, cls: type[C]) -> list[C]:
    """One client per service of `kind` (its replicas), in deploy-file order."""
    return [
        cls(
            r.name,
            cfg.address(r.name),
            max(r.max_message_bytes, svc.max_message_bytes),
            admin_address=cfg.admin_address(r.name),
            admin_metadata=auth.admin_metadata(r),
        )
        for r in cfg.services_of(kind)
    ]


def _image_stage(cfg: DeployConfig, svc: ServiceConfig) -> ImageStage:
    """The image stage's replicas with the deploy file's limits (their Describe's, once admitted)."""
    replicas = cfg.services_of("imagegen")
    # Releases only (hidden states that never reach ImageGen): the gateway maps no bytes of them. A
    # GPU image stage can open CUDA IPC handles, so hidden states made on a GPU may stay there.
    return ImageStage(
        _clients(cfg, svc, "imagegen", ImageGenClient),
        TransportContext(),
        ImageLimits.of(replicas[0].imagegen, None),
        allow_cuda_ipc=all(r.device == "cuda" for r in replicas),
        service=svc.name,
    )


_log = get_logger(__name__)

# Tokens of each timed warm-up request that seeds the thinker's pace (its steps at batch 1 and full).
_PACE_TOKENS = 16


async def _seed_pace(thinker: ThinkerClient, pace: StepPace, full_batch: int) -> None:
    """The start-up stress: timed warm-ups alone, then a quarter, half and full batch at once (of the
    thinker's max_running, when known); each gives the step time at its batch, so the first burst is
    admitted by what it costs at the batch it makes. Each request is timed from its call to its last
    token over its tokens (its prefill and queueing included): on a loaded host the gateway may read
    several deltas at once, and their arrival times would make the steps look faster than they are."""
    sampling = common_pb2.SamplingParams(max_tokens=_PACE_TOKENS, ignore_eos=True, temperature=0.0)
    prompt = build_chat([Turn("user", "warm-up")])

    async def one(name: str) -> float | None:
        started, tokens, last = time.monotonic(), 0, 0.0
        async for ev in thinker.generate(name, prompt, sampling, 120.0):
            if ev.WhichOneof("event") == "delta" and ev.delta.token_ids:
                tokens += len(ev.delta.token_ids)
                last = time.monotonic()
        return (last - started) / tokens if tokens else None

    full = max(1, full_batch)
    for batch in sorted({1, max(1, full // 4), max(1, full // 2), full}):
        steps = await asyncio.gather(*(one(f"gateway-pace-{batch}-{i}") for i in range(batch)))
        for step_s in filter(None, steps):
            pace.observe(batch, step_s)
        _log.info("thinker pace at a batch of %d: %.1f ms a step", batch, 1000 * (pace.step_s(batch) or 0))


async def _warm_up_thinker(thinker: ThinkerClient) -> None:
    """A real request end to end: the path the clients will take works."""
    warmup = build_chat([Turn("user", "warm-up")])
    async for _ in thinker.generate("gateway-warmup", warmup, common_pb2.SamplingParams(max_tokens=1), 60.0):
        pass


async def _warm_up_talker(talker: TalkerClient) -> None:
    """One sentence through Speak: the talker answers with speech before the gateway serves."""
    config = talker_pb2.SpeakConfig(request_id="gateway-warmup", seed=0)
    call = talker.speak(
        [talker_pb2.SpeakRequest(config=config), talker_pb2.SpeakRequest(text="Warm-up.", end_of_text=True)],
        60.0,
    )
    try:
        audio = False
        async for response in call:
            audio = audio or response.HasField("audio")
        if not audio:
            raise RuntimeError(f"{talker.name}: the warm-up sentence got no audio")
    finally:
        call.cancel()  # its credit comes back once the call is over


def _speech_stage(cfg: DeployConfig, svc: ServiceConfig) -> SpeechStage:
    gw = svc.gateway
    max_text_chars = min(t.talker.max_text_chars for t in cfg.services_of("talker"))
    limits = SpeechLimits(
        max_text_chars, gw.talker_start_wait_s, gw.talker_idle_timeout_s, gw.speech_buffer_events
    )
    return SpeechStage(_clients(cfg, svc, "talker", TalkerClient), limits, svc.name)


def _converse_limits(cfg: DeployConfig, svc: ServiceConfig) -> ConverseLimits:
    gw, encoders = svc.gateway, cfg.services_of("encoder")
    enc = encoders[0].encoder if encoders else None
    return ConverseLimits(
        gw.converse_max_turns,
        gw.converse_max_turn_chars,
        gw.converse_max_turn_audio_bytes,
        enc.max_audio_seconds if enc else ConverseLimits.max_audio_seconds,
        enc.max_items_per_request if enc else ConverseLimits.max_audio_items,
    )


class _Stages:
    """The gateway's stages and their watches, one per replica (the services of a kind): each replica is
    admitted when it is SERVING and passed its warm-up (the thinker first; text is served before speech
    and images), marked down when it stops answering, and admitted again when it is back (the launcher
    restarts it). A capability is ready while one replica of each stage kind it needs is up."""

    def __init__(
        self, runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, servicer: OmniServicer
    ) -> None:
        self.runtime, self.cfg, self.svc, self.servicer = runtime, cfg, svc, servicer
        self.pipeline = servicer.pipeline
        self.watches: dict[str, StageWatch] = {}  # by service name
        self.kinds: dict[str, list[StageClient]] = {}  # stage kind → its replicas' clients
        s = servicer.pipeline
        steps: dict[str, tuple[list[StageClient], Callable[[Any], Awaitable[None]]]] = {
            "thinker": ([s.thinker] if s.thinker else [], self._thinker_up),
            "encoder": ([s.media.encoder] if s.media else [], self._encoder_up),
            "talker": (s.speech.replicas.clients if s.speech else [], self._talker_up),
            "imagegen": (s.images.replicas.clients if s.images else [], self._imagegen_up),
        }
        for kind, (clients, on_up) in steps.items():
            for client in clients:
                self.kinds.setdefault(kind, []).append(client)
                self.watches[client.name] = StageWatch(
                    client, svc.gateway, functools.partial(on_up, client), self._changed
                )
                runtime.add_shutdown_hook(self.watches[client.name].stop)
                if kind in ("thinker", "talker"):  # the media and image stages close their own clients
                    runtime.add_shutdown_hook(client.close)

    def start(self) -> None:
        self._changed(None)  # every capability's health name exists (NOT_SERVING) from the start
        for w in self.watches.values():
            w.start()

    def readiness(self) -> list[control_pb2.Readiness]:
        out = []
        for name, kinds in CAPABILITIES.items():
            if not set(kinds) <= self.pipeline.deployed:
                continue
            down = [
                (c.name, c.down_reason)
                for k in kinds
                if not any(c.up for c in self.kinds[k])
                for c in self.kinds[k]
            ]
            reason = "; ".join(f"{n}: {why}" for n, why in down)
            out.append(control_pb2.Readiness(capability=name, ready=not down, reason=reason))
        return out

    def _changed(self, _client: StageClient | None) -> None:
        self.pipeline.stages_changed()
        ready = {r.capability: r.ready for r in self.readiness()}
        self.runtime.set_capability_health(ready)
        self.runtime.reporter.heartbeat(
            "ready: " + (", ".join(k for k, v in ready.items() if v) or "nothing yet")
        )

    async def _thinker_up(self, client: ThinkerClient) -> None:
        p = self.pipeline
        desc = await client.describe()  # None without an admin port: then only the thinker checks lengths
        if desc is not None:
            p.thinker_described(desc.limits)
        await self._through(client, _warm_up_thinker(client))
        await self._through(client, _seed_pace(client, p.pace, p.thinker_gate.cfg.max_running))

    async def _needs_thinker(self, what: str) -> None:
        """Warm-ups through the thinker wait for its admission (bounded by gateway.stage_wait_s)."""
        thinker = self.pipeline.thinker
        watch = self.watches.get(thinker.name) if thinker is not None else None
        if watch is None or not await watch.wait_admitted(self.svc.gateway.stage_wait_s):
            raise RuntimeError(f"{what} needs the thinker, which is not admitted")

    async def _encoder_up(self, encoder: EncoderClient) -> None:
        await self._needs_thinker("the media warm-up")
        desc = await encoder.describe()  # 0: it reports no request cap (its batcher decides)
        if desc is not None:
            self.pipeline.set_capacity("encoder", desc.limits.max_running_requests)
        await self._through(encoder, _warm_up_media(self.servicer))

    async def _talker_up(self, talker: TalkerClient) -> None:
        # The streams this gateway may hold open on it (Describe): the `talker` gate counts them once it
        # is admitted (_changed), with those of the other replicas that are up.
        await talker.read_limits()
        await self._through(talker, _warm_up_talker(talker))

    async def _imagegen_up(self, client: ImageGenClient) -> None:
        await self._needs_thinker("the image warm-up")
        images = self.pipeline.images
        desc = await client.describe()
        images.limits = ImageLimits.of(
            self.cfg.service(client.name).imagegen, desc.limits if desc is not None else None
        )
        gate = images.limits.gate()
        client.max_running, client.max_waiting = gate.max_running, gate.max_waiting
        try:
            await self._through(client, self._image_warm_up(client))
        finally:
            self.pipeline.size_image_gate()

    async def _image_warm_up(self, client: ImageGenClient) -> None:
        self.pipeline.size_image_gate()  # with this replica counted: its warm-up takes a slot of the gate
        await _warm_up_image(self.servicer, client)

    @staticmethod
    async def _through(client: StageClient, warm_up) -> None:
        """Run a warm-up request through `client` (let through although the stage is not admitted yet)."""
        reason, client.down_reason = client.down_reason, ""
        try:
            await warm_up
        except BaseException:
            client.down_reason = reason
            raise


def _one_of_each(cfg: DeployConfig) -> None:
    """The gateway calls one thinker and one encoder: replicas are served for the talker and the image
    stage only."""
    for kind in ("thinker", "encoder"):
        of_kind = cfg.services_of(kind)
        if len(of_kind) > 1:
            raise ConfigError(
                f"services: the gateway calls one {kind}, the deploy file has "
                f"{', '.join(s.name for s in of_kind)} (replicas: several services of kind talker "
                "or imagegen)"
            )


def _media_stage(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig) -> MediaStage | None:
    """The encoder's media path, closed at shutdown (None without an encoder)."""
    encoders, thinkers = cfg.services_of("encoder"), cfg.services_of("thinker")
    if not encoders:
        return None
    encoder = _clients(cfg, svc, "encoder", EncoderClient)[0]
    # Releases only (refs that never reach the thinker): the gateway maps no bytes of them.
    # A GPU thinker can open CUDA IPC handles, so embeddings made on a GPU may stay there.
    cuda_thinker = bool(thinkers) and thinkers[0].device == "cuda"
    media = MediaStage(
        encoder,
        TransportContext(),
        max_request_bytes=encoders[0].max_message_bytes,
        allow_cuda_ipc=cuda_thinker,
    )
    runtime.add_shutdown_hook(media.close)
    return media


def _pipeline(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig) -> Pipeline:
    """The stage clients the deploy file names, their admission gates and the gateway's limits."""
    gw = svc.gateway
    deployed = {s.kind for s in cfg.services.values() if s.kind != "gateway"}
    _one_of_each(cfg)
    thinkers = _clients(cfg, svc, "thinker", ThinkerClient)
    media = _media_stage(runtime, cfg, svc)
    images = _image_stage(cfg, svc) if cfg.services_of("imagegen") else None
    if images is not None:
        runtime.add_shutdown_hook(images.close)
    return Pipeline(
        thinkers[0] if thinkers else None,
        deployed,
        max_concurrent_requests=gw.max_concurrent_requests,
        limits=_request_limits(svc),
        system_prompt=gw.system_prompt,
        media_dir=gw.media_dir,
        media=media,
        speech=_speech_stage(cfg, svc) if cfg.services_of("talker") else None,
        images=images,
        gates={
            stage: StageGate(
                stage, GateConfig(0, gw.admission_max_waiting, gw.admission_initial_service_s), svc.name
            )
            for stage in MODEL_KINDS
            if stage in deployed
        },
        service=svc.name,
    )


def _serve_omni(runtime: ServiceRuntime, svc: ServiceConfig, servicer: OmniServicer, stages: _Stages) -> None:
    """The Omni service on the runtime's port, with what Describe and the load reports read."""
    gw, pipeline = svc.gateway, servicer.pipeline
    runtime.set_readiness_provider(stages.readiness)
    runtime.add_servicer(
        omni_pb2_grpc.add_OmniServicer_to_server,
        servicer,
        "omnistage.v1.Omni",
        bounds=wire_bounds(pipeline.limits),
    )
    runtime.set_limits_provider(
        lambda: control_pb2.Limits(
            max_running_requests=gw.max_concurrent_requests, max_message_bytes=svc.max_message_bytes
        )
    )
    runtime.set_load_provider(lambda: (pipeline.in_flight, pipeline.thinker_gate.waiting))


async def _wait_for_thinker(runtime: ServiceRuntime, svc: ServiceConfig, stages: _Stages) -> None:
    """Text first: the gateway turns SERVING as soon as the thinker is admitted (SERVING + a warm-up
    through the path clients take), bounded by gateway.stage_wait_s; the other stages join as their
    watches admit them (health names omnistage.v1.Omni.<capability>, Describe.readiness).
    `omnistage serve` calls the pipeline ready when every capability is (common/launcher/)."""
    gw, thinker = svc.gateway, stages.pipeline.thinker
    runtime.reporter.enter("warming_up", total=1, unit="stages")
    watch = stages.watches.get(thinker.name) if thinker is not None else None
    if watch is None:
        return
    runtime.reporter.heartbeat(f"waiting for {watch.client.name}")
    if not await watch.wait_admitted(gw.stage_wait_s) and not gw.allow_degraded:
        raise StageUnavailable(
            f"stage '{watch.client.name}' not admitted after {gw.stage_wait_s:g}s "
            f"(gateway.stage_wait_s): {watch.client.down_reason}"
        )
    runtime.reporter.advance()


async def build(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> None:
    servicer = OmniServicer(_pipeline(runtime, cfg, svc), _converse_limits(cfg, svc))
    stages = _Stages(runtime, cfg, svc, servicer)
    _serve_omni(runtime, svc, servicer, stages)
    export_host_memory(svc.name)  # no device: its host memory in the ledger's metrics
    stages.start()
    await _wait_for_thinker(runtime, svc, stages)
    if svc.gateway.http_port:
        await _start_http_front(runtime, cfg, svc, tuple(r.capability for r in stages.readiness()))
    runtime.set_serving()


async def _start_http_front(
    runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, capabilities: tuple[str, ...]
) -> None:
    """The OpenAI-compatible HTTP front (gateway.http_port), calling this gateway's own Omni port."""
    from omnistage.services.gateway.openai.serve import HttpFront

    front = HttpFront(cfg, svc, runtime.port, capabilities)
    await front.start()
    runtime.add_shutdown_hook(front.stop)


def _request_limits(svc: ServiceConfig) -> RequestLimits:
    gw = svc.gateway
    return RequestLimits(gw.max_messages, gw.max_parts_per_message, gw.max_prompt_chars)


def _receive_bytes(cfg: DeployConfig, svc: ServiceConfig) -> int:
    """The public API's gRPC receive limit: the largest request a legitimate client can send this
    deployment (media only with an encoder, a custom voice only with a talker)."""
    encoders, talkers = cfg.services_of("encoder"), cfg.services_of("talker")
    return public_receive_bytes(
        _request_limits(svc),
        encoders[0].max_message_bytes - MESSAGE_OVERHEAD if encoders else 0,
        talkers[0].max_message_bytes if talkers else 0,
    )


def main() -> None:
    run_service(sys.argv[1:], "gateway", build, receive_bytes=_receive_bytes)


if __name__ == "__main__":
    main()
