"""The talker as an output stage: an answer with MODALITY_AUDIO is spoken as it is written, its audio
chunks interleaved with its text in the same stream (one Talker.Speak call per answer:
talker_stream.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omnistage.common import metrics
from omnistage.common.config import DeployConfig, GatewayConfig, ServiceConfig, TalkerConfig
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.voice_rules import custom_voice_problem, voice_name_problem
from omnistage.services.gateway.admission import StageGate
from omnistage.services.gateway.outputs import OutputStage, Startup
from omnistage.services.gateway.outputs.talker_stream import TalkerStream
from omnistage.services.gateway.replicas import Replicas
from omnistage.services.gateway.stages import TalkerClient
from omnistage.services.gateway.validation import PlannedRequest
from omnistage.v1 import omni_pb2, talker_pb2


@dataclass(frozen=True)
class VoiceChoice:
    """How an answer is spoken: a preset name ("" = the talker's default) or a clip, and the seed."""

    voice: str = ""
    clip: omni_pb2.VoiceClip | None = None
    seed: int | None = None

    def config(self, request_id: str) -> talker_pb2.SpeakConfig:
        seed = {} if self.seed is None else {"seed": self.seed}
        if self.clip is not None:
            clip = talker_pb2.CustomVoice(audio=self.clip.audio, transcript=self.clip.transcript)
            return talker_pb2.SpeakConfig(request_id=request_id, custom_voice=clip, **seed)
        return talker_pb2.SpeakConfig(request_id=request_id, voice=self.voice, **seed)


def voice_choice(request: omni_pb2.GenerateRequest, where: str = "") -> VoiceChoice:
    """The speech settings of a request (`where` prefixes field names: "config." in Converse)."""
    seed = request.sampling.seed if request.sampling.HasField("seed") else None
    if (problem := voice_name_problem(request.voice)) is not None:
        raise InvalidRequest(where + problem)
    if not request.HasField("custom_voice"):
        return VoiceChoice(request.voice, None, seed)
    if request.voice:
        raise InvalidRequest(f"{where}custom_voice: set voice or custom_voice, not both")
    if (
        problem := custom_voice_problem(request.custom_voice.audio, request.custom_voice.transcript)
    ) is not None:
        raise InvalidRequest(where + problem)
    return VoiceChoice("", request.custom_voice, seed)


@dataclass(frozen=True)
class SpeechLimits:
    """The gateway's speech knobs (docs/config.md) and the talker's text limit (its deploy-file key);
    the defaults are the deploy file's (the config classes own them)."""

    max_text_chars: int = TalkerConfig.max_text_chars
    start_wait_s: float = GatewayConfig.talker_start_wait_s
    idle_timeout_s: float = GatewayConfig.talker_idle_timeout_s
    buffer_events: int = GatewayConfig.speech_buffer_events
    stream_wait_s: float = GatewayConfig.talker_stream_wait_s


class SpeechStage(OutputStage):
    """The gateway's side of the talker: its replicas and their streams (the `talker` gate: the streams
    of the replicas that are up, together), and what the clients got."""

    kind = "talker"
    client_class = TalkerClient
    joins = True  # the audio joins the answer when a stream is free: the text never waits for one

    def __init__(
        self, talker: TalkerClient | Sequence[TalkerClient], limits: SpeechLimits, service: str = "gateway"
    ) -> None:
        # The talker's replicas (replicas.py): each answer speaks on the least loaded one with a credit.
        self.replicas = Replicas("talker", [talker] if isinstance(talker, TalkerClient) else talker, service)
        self.talker = self.replicas.first
        self.limits = limits
        self.service = service
        # The streams this gateway holds: the admission's `talker` gate (the pipeline sets it).
        self.gate: StageGate | None = None
        self._ttfa = metrics.histogram(
            "gateway_ttfa_seconds",
            "Time to first audio as the client sees it: request "
            "arrival at the gateway (Converse: end of the user turn) to the first audio "
            "chunk sent, by voice",
            ("voice",),
        )
        self._outcomes = metrics.counter(
            "gateway_speech_outcomes",
            "Answers by what became of their speech "
            "(AudioOutcome) and why (gRPC code name, empty when complete)",
            ("outcome", "code"),
        )
        self._moves = metrics.counter(
            "gateway_speech_moves",
            "Spoken answers whose talker replica was lost under their speech and that went on on "
            "another replica (their Finish.audio says how that ended), by the replica lost",
            ("replica",),
        )

    @classmethod
    def from_deploy(
        cls, cfg: DeployConfig, svc: ServiceConfig, clients: Sequence[TalkerClient]
    ) -> SpeechStage:
        gw = svc.gateway
        max_text_chars = min(t.talker.max_text_chars for t in cfg.services_of("talker"))
        limits = SpeechLimits(
            max_text_chars,
            gw.talker_start_wait_s,
            gw.talker_idle_timeout_s,
            gw.speech_buffer_events,
            gw.talker_stream_wait_s,
        )
        return cls(clients, limits, svc.name)

    def plan(self, request: omni_pb2.GenerateRequest, planned: PlannedRequest) -> VoiceChoice:
        return voice_choice(request)

    def capacity(self) -> tuple[int, int | None]:
        """The streams the talker replicas that are up speak at once, together (the `talker` gate's
        size); 0 (no limit here) while an up replica's is unknown; none up: all replicas' (no answer
        waits on the gate then: its speech is UNAVAILABLE, the text goes on)."""
        up = self.replicas.up() or self.replicas.clients
        return (0 if any(not t.max_streams for t in up) else sum(t.max_streams for t in up)), None

    async def on_up(self, client: TalkerClient, startup: Startup) -> None:
        # The streams this gateway may hold open on it (Describe): the `talker` gate counts them once
        # it is admitted, with those of the other replicas that are up. Its warm-up's Speak call needs
        # no letting through (a Speak call checks nothing): no answer speaks on it before it is admitted.
        await client.read_limits()
        await warm_up_talker(client)

    def during(self, run: Any, options: VoiceChoice, answer: Any) -> TalkerStream:
        return TalkerStream(self, answer, options.config(run.request_id))

    def moved(self, lost: str) -> None:
        """A speech went on on another replica after the replica `lost` went down under it."""
        self._moves.labels(self.service, lost).inc()

    def observe(self, status: omni_pb2.AudioStatus) -> None:
        self._outcomes.labels(self.service, omni_pb2.AudioOutcome.Name(status.outcome), status.code).inc()
        if status.samples:
            self._ttfa.labels(self.service, status.voice).observe(status.time_to_first_audio_ms / 1000)


async def warm_up_talker(talker: TalkerClient) -> None:
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


OUTPUT_STAGE = SpeechStage
