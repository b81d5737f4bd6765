"""Speech of an answer: the thinker's text goes to the client and, as it decodes, into one Talker.Speak
call, whose audio chunks reach the client interleaved with the text in the same stream."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from omnistage.common import metrics
from omnistage.common.config import GatewayConfig, TalkerConfig
from omnistage.common.runtime.deadlines import cancel_and_wait, within
from omnistage.common.runtime.errors import RETRY_PUSHBACK_KEY, InvalidRequest
from omnistage.common.voice_rules import custom_voice_problem, voice_name_problem
from omnistage.services.gateway.replicas import Replicas, in_flight_share
from omnistage.services.gateway.stages import HandedOver, TalkerClient, broken_stream, take_end
from omnistage.v1 import common_pb2, omni_pb2, talker_pb2

# Pushback a client gets when this gateway already holds all the talker's streams (the talker's own).
NO_CREDIT_RETRY_MS = 500
# How long an answer's own tasks (text pump, talker writer/reader) have to end once cancelled; a task
# still running then is logged and left behind, so that the request ends whatever it does.
TASK_STOP_S = 5.0
_SPOKEN_REASONS = {
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_STOP_STRING,
}


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


class SpeechStage:
    """The gateway's side of the talker: speaks answers, counts what the clients got."""

    def __init__(
        self, talker: TalkerClient | Sequence[TalkerClient], limits: SpeechLimits, service: str = "gateway"
    ) -> None:
        # The talker's replicas (replicas.py): each answer speaks on the least loaded one with a credit.
        self.replicas = Replicas("talker", [talker] if isinstance(talker, TalkerClient) else talker, service)
        self.talker = self.replicas.first
        self.limits = limits
        self.service = service
        # Set when a credit may have come back (a Speak call ended, a replica was admitted): speech
        # the `talker` gate let through waits for it instead of being refused.
        self._credit = asyncio.Event()
        for t in self.replicas.clients:
            t.on_credit = self._credit.set
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

    def capacity(self) -> int:
        """The streams the talker replicas that are up speak at once, together (the `talker` gate's size);
        0 (no limit here) while an up replica's is unknown; none up: all replicas' (no answer waits on
        a gate then: speech is UNAVAILABLE, the text goes on)."""
        up = self.replicas.up() or self.replicas.clients
        return 0 if any(not t.max_streams for t in up) else sum(t.max_streams for t in up)

    def credit_back(self) -> None:
        """A credit may be free now (a replica was admitted): the speech waiting for one looks again."""
        self._credit.set()

    async def wait_credit(self, timeout_s: float) -> None:
        """Until a credit may be free, at most `timeout_s` (the caller looks again either way)."""
        self._credit.clear()
        with contextlib.suppress(TimeoutError):
            await within(self._credit.wait(), timeout_s)

    def observe(self, status: omni_pb2.AudioStatus) -> None:
        self._outcomes.labels(self.service, omni_pb2.AudioOutcome.Name(status.outcome), status.code).inc()
        if status.samples:
            self._ttfa.labels(self.service, status.voice).observe(status.time_to_first_audio_ms / 1000)


@dataclass
class _Done:
    """A pump is done (text: with the thinker's finish event)."""

    finish: omni_pb2.GenerateEvent | None = None


@dataclass
class _TextBuffer:
    """Text on its way to the talker: appended without blocking, taken by the writer."""

    limit: int
    pending: list[str] = field(default_factory=list)
    chars: int = 0
    ended: bool = False
    truncated: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    all_in: asyncio.Event = field(default_factory=asyncio.Event)  # ended: no more text will come

    def push(self, text: str) -> None:
        if self.ended or not text:
            return
        room = self.limit - self.chars
        if len(text) > room:
            text, self.truncated = text[:room], True
        self.chars += len(text)
        self.pending.append(text)
        self.wake.set()
        if self.truncated:
            self.end()

    def end(self) -> None:
        self.ended = True
        self.wake.set()
        self.all_in.set()

    def take(self) -> str:
        text = "".join(self.pending)
        self.pending.clear()
        self.wake.clear()
        return text


_talker_load = in_flight_share(lambda t: t.max_streams)


class _SpeakRequests:
    """What one Speak call sends: the config, then (once the talker accepted it) the answer's text as it
    comes, end_of_text last. Its only reader is grpc's task for the call (TalkerClient.speak); its
    owner ends it with `stop` on every path (the call over, the answer closing), after which grpc
    half-closes a live call or finds it over, and its task ends either way."""

    def __init__(self, config: talker_pb2.SpeakConfig, text: _TextBuffer, accepted: asyncio.Event) -> None:
        self._config: talker_pb2.SpeakConfig | None = config
        self._text = text
        self._accepted = accepted
        self._over = False  # end_of_text went out, or `stop`: nothing more to send

    def stop(self) -> None:
        """Nothing more to send: the next read (or the one waiting now) ends the stream."""
        self._over = True
        self._text.wake.set()
        self._accepted.set()

    def __aiter__(self) -> _SpeakRequests:
        return self

    async def __anext__(self) -> talker_pb2.SpeakRequest:
        if self._config is not None:
            config, self._config = self._config, None
            return talker_pb2.SpeakRequest(config=config)
        # No text before the talker's verdict on the config: a write racing its refusal makes grpc
        # report INTERNAL "Internal error from Core" instead of the talker's status (4 % of calls).
        await self._accepted.wait()
        while not self._over:
            ended, text = self._text.ended, self._text.take()
            if text or ended:
                self._over = ended
                return talker_pb2.SpeakRequest(text=text, end_of_text=ended)
            await self._text.wake.wait()
        raise StopAsyncIteration


class TalkerStream:
    """One Speak call: its request stream, its reader task, and the AudioStatus of what it gave. The first
    reason the speech stopped short is the one the status keeps."""

    def __init__(
        self,
        stage: SpeechStage,
        request_id: str,
        choice: VoiceChoice,
        timeout_s: float | None,
        where: str,
        on_over: Callable[[], None] = lambda: None,
    ) -> None:
        self.stage = stage
        # Called once the speech is over: no call opened, or the call ended (after its credit came back).
        self.on_over = on_over
        self.talker = stage.talker  # the replica it speaks on (start() picks it)
        self.limits = stage.limits
        self.request_id = request_id
        self.choice = choice
        self.timeout_s = timeout_s
        self.where = where
        self.text = _TextBuffer(self.limits.max_text_chars)
        self.status = omni_pb2.AudioStatus()
        self.accepted = asyncio.Event()  # the talker started, or the speech is over
        self.released = False  # text has gone to the client: a refusal now ends only the speech
        self.finished = False  # the talker said `finished`
        self.requests = _SpeakRequests(choice.config(request_id), self.text, self.accepted)
        self.call: grpc.aio.StreamStreamCall | None = None
        self._tasks: list[asyncio.Task] = []
        self._reading = False  # the reader waits for the talker (not for the client)
        self._read_since = 0.0
        self._chunks = 0
        self._segment = 0
        self._stopped = False  # the gateway cancelled the call (stop): the status says why

    async def start(self) -> bool:
        """Open the Speak call on the least loaded talker replica with a credit (False, with the status
        set, when none is up, or this gateway holds all their streams past `start_wait_s`). The
        `talker` gate let this answer through for a stream: a call that just ended may hold its
        credit a moment longer, a replica may be coming back; so it waits for one (bounded)."""
        replicas = self.stage.replicas
        loop = asyncio.get_running_loop()
        until = loop.time() + self.limits.start_wait_s
        while (talker := replicas.pick(_talker_load, TalkerClient.has_credit)) is None:
            if not replicas.up() or loop.time() >= until:
                break
            await self.stage.wait_credit(until - loop.time())
        if talker is None:
            up = replicas.up()
            if not up:  # the text goes on; the status says why there is no speech
                self.fail("UNAVAILABLE", replicas.unavailable().args[0])
            else:
                self.fail(
                    "RESOURCE_EXHAUSTED",
                    ", ".join(f"{t.name}: all {t.max_streams} streams are speaking" for t in up),
                    NO_CREDIT_RETRY_MS,
                )
            self.accepted.set()
            self.on_over()
            return False
        self.talker = talker
        self.call = talker.speak(self.requests, self.timeout_s)
        self.call.add_done_callback(lambda _call: self.on_over())  # after the replica's credit came back
        return True

    def run(self, out: asyncio.Queue) -> None:
        assert self.call is not None
        self._tasks = [
            asyncio.create_task(self._read(self.call, out)),
            asyncio.create_task(self._watch_silence(self.call)),
        ]

    def stop(self, code: str, message: str) -> None:
        """Stop speaking (the answer was aborted or interrupted): cancel the call, say why in the status."""
        self.fail(code, message)
        self.requests.stop()
        if self.call is not None and not self.call.done():
            self._stopped = True
            self.call.cancel()

    async def close(self) -> None:
        """Cancel what still runs (the call first: the talker frees the stream's state), end the request
        stream (grpc's task reading it ends too when the call was over already) and wait (bounded) for
        the answer's tasks."""
        if self.call is not None:
            self.call.cancel()
        self.requests.stop()
        await cancel_and_wait(self._tasks, TASK_STOP_S, f"speech of {self.request_id}: talker stream")

    def fail(self, code: str, message: str, retry_after_ms: int = 0) -> None:
        if not self.status.code:
            self.status.code, self.status.message, self.status.retry_after_ms = code, message, retry_after_ms

    async def _watch_silence(self, call: grpc.aio.StreamStreamCall) -> None:
        """Once the text has ended the talker must keep answering (a talker that stopped, or never took the
        connection, is given up). Silence counts only while the reader waits for the talker, not while
        it waits for a slow client."""
        await self.text.all_in.wait()
        ended_at, idle = time.monotonic(), self.limits.idle_timeout_s
        while not call.done():
            silent = time.monotonic() - max(self._read_since, ended_at) if self._reading else 0.0
            if silent >= idle:
                self.stop(
                    "DEADLINE_EXCEEDED",
                    f"{self.talker.name}: no speech for {idle:g}s (gateway.talker_idle_timeout_s)",
                )
                return
            await asyncio.sleep(idle - silent)

    async def _read(self, call: grpc.aio.StreamStreamCall, out: asyncio.Queue) -> None:
        try:
            await self._read_speech(call, out)
        except grpc.aio.AioRpcError as exc:
            refusal = self._refused_or_failed(exc)
            if refusal is not None:
                await out.put(refusal)  # before `accepted`: the text pump waits for this verdict
        except asyncio.CancelledError:
            if self.talker.lost_call():  # the talker went down under the call: the text goes on
                self.fail("UNAVAILABLE", self.talker.unavailable().args[0])
            elif asyncio.current_task().cancelling() or not self._stopped:
                raise  # this task was cancelled (the answer is closing), not only the call
        finally:
            self.requests.stop()  # the speech is over (`accepted`): nothing more goes to the call
        if self._chunks:  # however it ended, the audio sent ends with a `last` chunk
            await out.put(
                omni_pb2.GenerateEvent(
                    request_id=self.request_id,
                    audio=omni_pb2.AudioChunk(
                        sample_rate_hz=self.status.sample_rate_hz, segment_index=self._segment, last=True
                    ),
                )
            )
        await out.put(_Done())

    async def _read_speech(self, call: grpc.aio.StreamStreamCall, out: asyncio.Queue) -> None:
        name = self.talker.name
        while True:
            self._reading, self._read_since = True, time.monotonic()
            response = await call.read()
            self._reading = False
            if response is grpc.aio.EOF:
                self.fail("UNAVAILABLE", f"{name}: the stream ended before it finished")
                return
            kind = response.WhichOneof("event")
            if kind == "started":
                self.status.voice = response.started.voice
                self.status.sample_rate_hz = response.started.sample_rate_hz
                self.accepted.set()
            elif kind == "audio":
                a = response.audio
                self._chunks += 1
                self._segment = a.segment_index
                chunk = omni_pb2.AudioChunk(
                    pcm16=a.pcm16, sample_rate_hz=self.status.sample_rate_hz, segment_index=a.segment_index
                )
                await out.put(omni_pb2.GenerateEvent(request_id=self.request_id, audio=chunk))
            elif kind == "segment_done":
                self.status.segments += 1
            elif kind == "finished":
                self.finished = True
                if self.text.truncated:
                    self.fail(
                        "OUT_OF_RANGE",
                        f"the answer passed the talker's max_text_chars "
                        f"({self.limits.max_text_chars} characters): spoken up to there",
                    )
                await take_end(call)  # the last event: its own end (OK), not a cancel on close
                return

    def _refused_or_failed(self, exc: grpc.aio.AioRpcError) -> InvalidRequest | None:
        """Set the status from the talker's error; the client's error when it refused the request's voice
        before any text was let through (then the request fails as a whole, naming the field)."""
        details = exc.details() or ""
        if not self.talker.up and exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
            self.fail("UNAVAILABLE", self.talker.unavailable().args[0])  # went down under the call
            return None
        if broken_stream(exc) or exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.talker.unreachable(details)  # its watch takes it out now: new answers speak elsewhere
        if broken_stream(exc):  # the talker died under the call before its watch noticed
            self.fail("UNAVAILABLE", f"{self.talker.name}: the stream broke ({details})")
            return None
        pushback = str(dict(exc.trailing_metadata() or ()).get(RETRY_PUSHBACK_KEY, "0"))
        self.fail(
            exc.code().name, f"{self.talker.name}: {details}", int(pushback) if pushback.isdigit() else 0
        )
        if (
            exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            and details.startswith("config.")
            and not self.status.voice
            and not self.released
        ):
            return InvalidRequest(self.where + details.removeprefix("config."))
        return None


class SpokenAnswer:
    """One answer with speech: runs the text pump and a TalkerStream, yields their events in order. Its
    `status` counts what the client was sent."""

    def __init__(
        self,
        stage: SpeechStage,
        request_id: str,
        choice: VoiceChoice,
        timeout_s: float | None,
        arrived_at: float,
        where: str = "",
        on_speech_over: Callable[[], None] = lambda: None,
    ) -> None:
        self.stage = stage
        self.arrived_at = arrived_at
        self.out: asyncio.Queue = asyncio.Queue(stage.limits.buffer_events)
        self.speech = TalkerStream(stage, request_id, choice, timeout_s, where, on_speech_over)
        self.status = self.speech.status

    async def events(
        self, text_events: AsyncIterator[omni_pb2.GenerateEvent | HandedOver]
    ) -> AsyncIterator[omni_pb2.GenerateEvent | HandedOver]:
        """`text_events` (the thinker's, HandedOver for its `started`) with the speech interleaved; the
        Finish comes last, once both the text and the speech are done, with `audio` set."""
        pump = asyncio.create_task(self._pump_text(text_events))
        try:
            finish, done = None, 0
            while done < 2:
                item = await self.out.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Done):
                    done += 1
                    finish = item.finish or finish
                    continue
                if isinstance(item, omni_pb2.GenerateEvent) and item.HasField("audio"):
                    self._count(item.audio)
                yield item
            assert finish is not None
            self._settle()
            finish.finish.audio.CopyFrom(self.status)
            yield finish
        finally:
            try:
                await cancel_and_wait([pump], TASK_STOP_S, f"speech of {self.speech.request_id}: text pump")
            finally:  # even when cancelled again while the pump stops: the Speak call ends
                await self.speech.close()

    def interrupted(self, message: str) -> omni_pb2.AudioStatus:
        """The status of an answer cut off by the client (Converse barge-in)."""
        self.speech.fail("CANCELLED", message)
        self._settle()
        return self.status

    def _count(self, chunk: omni_pb2.AudioChunk) -> None:
        if chunk.pcm16 and not self.status.samples:
            self.status.time_to_first_audio_ms = (time.monotonic() - self.arrived_at) * 1000
        self.status.samples += len(chunk.pcm16) // 2

    def _settle(self) -> None:
        status = self.status
        if self.speech.finished and not status.code:
            status.outcome = omni_pb2.AUDIO_OUTCOME_COMPLETE
        else:
            status.outcome = omni_pb2.AUDIO_OUTCOME_PARTIAL if status.samples else omni_pb2.AUDIO_OUTCOME_NONE
            if not status.code:
                status.code, status.message = (
                    "UNAVAILABLE",
                    f"{self.speech.talker.name}: the speech did not finish",
                )
        self.stage.observe(status)

    async def _pump_text(self, text_events: AsyncIterator[omni_pb2.GenerateEvent | HandedOver]) -> None:
        speech, out = self.speech, self.out
        started = False
        finish = None
        try:
            async for event in text_events:
                if isinstance(event, HandedOver):  # the thinker took the request: speak its answer
                    started = True
                    if await speech.start():
                        speech.run(out)
                    else:
                        await out.put(_Done())  # no speech: its part is done
                    await out.put(event)
                elif event.HasField("text"):
                    speech.text.push(event.text.text)
                    await self._release_text()
                    await out.put(event)
                else:  # the finish: held back until the speech is done too
                    finish = event
                    if finish.finish.reason in _SPOKEN_REASONS:
                        speech.text.end()
                    else:
                        reason = common_pb2.FinishReason.Name(finish.finish.reason)
                        speech.stop("CANCELLED", f"the answer ended with {reason}: not spoken to its end")
        except Exception as exc:  # noqa: BLE001 - the thinker's error ends the request: handed to the reader
            await out.put(exc)
            return
        finally:
            with contextlib.suppress(Exception):
                await text_events.aclose()
        if not started:
            await out.put(_Done())
        await out.put(_Done(finish))

    async def _release_text(self) -> None:
        """Before the first text goes out: wait (bounded) for the talker to accept the voice."""
        speech = self.speech
        if speech.released:
            return
        with contextlib.suppress(TimeoutError):
            await within(speech.accepted.wait(), self.stage.limits.start_wait_s)
        speech.released = True
