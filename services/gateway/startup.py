"""The gateway's start-up from the stage table (common/stages.py): for each deployed kind its clients
(one per replica), its admission gate, and the watch that admits each replica once it is SERVING and
its warm-up went through — the thinker and the encoder here, every output stage by its adapter
(outputs/<kind>.py)."""

from __future__ import annotations

import asyncio
import functools
import io
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from omnistage.common.config import ConfigError, DeployConfig, GatewayConfig, ServiceConfig
from omnistage.common.log import get_logger
from omnistage.common.runtime import auth
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.stages import CAPABILITIES, STAGES, Stage
from omnistage.common.transport import TransportContext
from omnistage.services.gateway.admission import GateConfig, StageGate
from omnistage.services.gateway.encode_cache import EncodeCache
from omnistage.services.gateway.media import MediaStage
from omnistage.services.gateway.outputs import output_stage
from omnistage.services.gateway.pace import CHARS_PER_TOKEN, StepPace
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.prompt import Turn, build_chat, prompt_chars
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.stage_watch import StageWatch
from omnistage.services.gateway.stages import EncoderClient, StageClient, ThinkerClient
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import common_pb2, control_pb2, omni_pb2

C = TypeVar("C", bound=StageClient)
T = TypeVar("T")
_log = get_logger(__name__)
# Tokens of each timed warm-up request that seeds the thinker's pace (its steps at batch 1 and full).
PACE_TOKENS = 16


class _Deadline:
    """The one thing the servicer asks of a call context, for the start-up requests."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def time_remaining(self) -> float:
        return self.seconds


def clients(cfg: DeployConfig, svc: ServiceConfig, kind: str, cls: type[C]) -> list[C]:
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


def request_limits(svc: ServiceConfig) -> RequestLimits:
    gw = svc.gateway
    return RequestLimits(gw.max_messages, gw.max_parts_per_message, gw.max_prompt_chars)


def build_pipeline(
    runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, stages: Sequence[Stage] = STAGES
) -> Pipeline:
    """The stage clients the deploy file names, by the table's rows: the thinker, the encoder's media
    path, each output stage (its adapter), an admission gate per model kind, the gateway's limits."""
    gw = svc.gateway
    deployed = {s.kind for s in cfg.services.values() if s.kind != "gateway"}
    _one_of_each(cfg)
    thinkers = clients(cfg, svc, "thinker", ThinkerClient)
    for thinker in thinkers:
        runtime.add_shutdown_hook(thinker.close)
    outputs = []
    for row in stages:
        if row.outputs and cfg.services_of(row.kind):
            cls = output_stage(row.kind)
            stage = cls.from_deploy(cfg, svc, clients(cfg, svc, row.kind, cls.client_class))
            runtime.add_shutdown_hook(stage.close)
            outputs.append(stage)
    gate = GateConfig(0, gw.admission_max_waiting, gw.admission_initial_service_s)
    media = _media_stage(runtime, cfg, svc)
    return Pipeline(
        thinkers[0] if thinkers else None,
        deployed,
        max_concurrent_requests=gw.max_concurrent_requests,
        limits=request_limits(svc),
        system_prompt=gw.system_prompt,
        media_dir=gw.media_dir,
        media=media,
        kept=_encode_cache(runtime, cfg, svc, media),
        outputs=outputs,
        gates={
            s.kind: StageGate(s.kind, gate, svc.name)
            for s in stages
            if s.loads_checkpoint and s.kind in deployed
        },
        service=svc.name,
        buffer_events=gw.speech_buffer_events,
        stages=stages,
    )


def _one_of_each(cfg: DeployConfig) -> None:
    """The gateway calls one thinker and one encoder: replicas are served for the output stages only."""
    for kind in ("thinker", "encoder"):
        of_kind = cfg.services_of(kind)
        if len(of_kind) > 1:
            raise ConfigError(
                f"services: the gateway calls one {kind}, the deploy file has "
                f"{', '.join(s.name for s in of_kind)} (replicas: several services of kind talker "
                "or imagegen)"
            )


def _media_stage(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig) -> MediaStage | None:
    """The encoder's media path, closed at shutdown (None without an encoder). Releases only (refs that
    never reach the thinker): the gateway maps no bytes of them. A GPU thinker can open CUDA IPC
    handles, so embeddings made on a GPU may stay there."""
    encoders, thinkers = cfg.services_of("encoder"), cfg.services_of("thinker")
    if not encoders:
        return None
    media = MediaStage(
        clients(cfg, svc, "encoder", EncoderClient)[0],
        TransportContext(),
        max_request_bytes=encoders[0].max_message_bytes,
        allow_cuda_ipc=bool(thinkers) and thinkers[0].device == "cuda",
    )
    runtime.add_shutdown_hook(media.close)
    return media


def _encode_cache(
    runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, media: MediaStage | None
) -> EncodeCache | None:
    """Conversations' encoded clips kept across their turns (gateway.converse_kept_encodings), within a
    quarter of the encoder's transport pool (what their leases hold there); None: off, or no encoder."""
    count = svc.gateway.converse_kept_encodings
    if media is None or not count:
        return None
    pool = cfg.services_of("encoder")[0].encoder.transport_pool_bytes
    cache = EncodeCache(media, count, pool // 4, svc.name)
    runtime.add_shutdown_hook(cache.close)  # before the media path closes (hooks run in reverse)
    return cache


class Stages:
    """The gateway's stages and their watches, one per replica (the services of a kind): each replica is
    admitted when it is SERVING and passed its warm-up (the thinker first; text is served before speech
    and images), marked down when it stops answering, and admitted again when it is back (the launcher
    restarts it). A capability is ready while one replica of each stage kind it needs is up."""

    def __init__(
        self,
        runtime: ServiceRuntime,
        gw: GatewayConfig,
        servicer: OmniServicer,
        stages: Sequence[Stage] = STAGES,
    ) -> None:
        self.runtime, self.gw, self.servicer = runtime, gw, servicer
        self.pipeline = servicer.pipeline
        self.watches: dict[str, StageWatch] = {}  # by service name
        self.kinds: dict[str, list[StageClient]] = {}  # stage kind → its replicas' clients
        for row in stages:
            for client, on_up in self._replicas(row):
                self.kinds.setdefault(row.kind, []).append(client)
                watch = StageWatch(client, gw, functools.partial(on_up, client), self._changed)
                self.watches[client.name] = watch
                runtime.add_shutdown_hook(watch.stop)

    def _replicas(self, row: Stage) -> list[tuple[StageClient, Callable[[Any], Awaitable[None]]]]:
        """Each replica of a kind and what admits it (its Describe and warm-up)."""
        p = self.pipeline
        if row.kind == "thinker" and p.thinker is not None:
            return [(p.thinker, self._thinker_up)]
        if row.kind == "encoder" and p.media is not None:
            return [(p.media.encoder, self._encoder_up)]
        stage = p.outputs.get(row.kind)
        if stage is None:
            return []
        return [(c, functools.partial(stage.on_up, startup=self)) for c in stage.replicas.clients]

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
                if not any(c.up for c in self.kinds.get(k, []))
                for c in self.kinds.get(k, [])
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

    # -- what an output stage's on_up may ask (outputs.Startup) ---------------------------------

    async def needs_thinker(self, what: str) -> None:
        """Warm-ups through the thinker wait for its admission (bounded by gateway.stage_wait_s)."""
        thinker = self.pipeline.thinker
        watch = self.watches.get(thinker.name) if thinker is not None else None
        if watch is None or not await watch.wait_admitted(self.gw.stage_wait_s):
            raise RuntimeError(f"{what} needs the thinker, which is not admitted")

    async def generate(
        self, request: omni_pb2.GenerateRequest, timeout_s: float
    ) -> list[omni_pb2.GenerateEvent]:
        return [e async for e in self.servicer.Generate(request, _Deadline(timeout_s))]

    @staticmethod
    async def through(client: StageClient, warm_up: Awaitable[T]) -> T:
        """Run a warm-up request through `client` (let through although the stage is not admitted yet)."""
        reason, client.down_reason = client.down_reason, ""
        try:
            return await warm_up
        except BaseException:
            client.down_reason = reason
            raise

    def resize(self) -> None:
        self.pipeline.stages_changed()

    # -- the input stages ------------------------------------------------------------------------

    async def _thinker_up(self, client: ThinkerClient) -> None:
        p = self.pipeline
        desc = await client.describe()  # None without an admin port: then only the thinker checks lengths
        if desc is not None:
            p.thinker_described(desc.limits)
        await self.through(client, warm_up_thinker(client))
        await self.through(client, seed_pace(client, p.admission.pace, p.thinker_gate.cfg.max_running))
        _log.info(
            "thinker: a step grows %.1f us a token of context of each sequence (its Describe's decode steps)",
            1e6 * p.admission.pace.per_context_token_s,
        )

    async def _encoder_up(self, encoder: EncoderClient) -> None:
        await self.needs_thinker("the media warm-up")
        desc = await encoder.describe()  # 0: it reports no request cap (its batcher decides)
        if desc is not None:
            self.pipeline.admission.set_capacity("encoder", desc.limits.max_running_requests)
        await self.through(encoder, warm_up_media(self))


async def warm_up_thinker(thinker: ThinkerClient) -> None:
    """A real request end to end: the path the clients will take works."""
    warmup = build_chat([Turn("user", "warm-up")])
    async for _ in thinker.generate("gateway-warmup", warmup, common_pb2.SamplingParams(max_tokens=1), 60.0):
        pass


async def seed_pace(thinker: ThinkerClient, pace: StepPace, full_batch: int) -> None:
    """The start-up stress: timed warm-ups alone, then a quarter, half and full batch at once (of the
    thinker's max_running, when known); each gives the step time at its batch, so the first burst is
    admitted by what it costs at the batch it makes. Each request is timed from its call to its last
    token over its tokens (its prefill and queueing included): on a loaded host the gateway may read
    several deltas at once, and their arrival times would make the steps look faster than they are.
    Its answers are short: how a step grows at a longer context is the thinker's Describe's."""
    sampling = common_pb2.SamplingParams(max_tokens=PACE_TOKENS, ignore_eos=True, temperature=0.0)
    prompt = build_chat([Turn("user", "warm-up")])
    context = prompt_chars(prompt) / CHARS_PER_TOKEN  # of each request; its answer adds half its tokens

    async def one(name: str) -> tuple[float, int] | None:
        started, tokens, last = time.monotonic(), 0, 0.0
        async for ev in thinker.generate(name, prompt, sampling, 120.0):
            if ev.WhichOneof("event") == "delta" and ev.delta.token_ids:
                tokens += len(ev.delta.token_ids)
                last = time.monotonic()
        return ((last - started) / tokens, tokens) if tokens else None

    full = max(1, full_batch)
    for batch in sorted({1, max(1, full // 4), max(1, full // 2), full}):
        runs = await asyncio.gather(*(one(f"gateway-pace-{batch}-{i}") for i in range(batch)))
        for step_s, tokens in filter(None, runs):
            pace.observe(batch, step_s, context + tokens / 2)
        _log.info("thinker pace at a batch of %d: %.1f ms a step", batch, 1000 * (pace.step_s(batch) or 0))


def _warmup_image() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 140, 200)).save(buf, format="PNG")
    return buf.getvalue()


async def warm_up_media(stages: Stages) -> None:
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
    events = await stages.generate(request, 60.0)
    if not events or events[-1].WhichOneof("event") != "finish":
        raise RuntimeError("the media warm-up request ended without a finish")
