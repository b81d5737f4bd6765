"""Omni.Converse: one call, many turns; each user turn is answered with text and speech (or with text
only, when the config's output_modalities is [MODALITY_TEXT]: then no talker is needed)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from omnistage.common.config import EncoderConfig, GatewayConfig
from omnistage.common.request_ids import MAX_REQUEST_ID_CHARS, valid_request_id
from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable
from omnistage.common.sampling import check_sampling
from omnistage.services.gateway.history import Entry, History, wav_of
from omnistage.services.gateway.pipeline import EncodedMedia, Pipeline
from omnistage.services.gateway.prompt import DEFAULT_SYSTEM_PROMPT
from omnistage.services.gateway.speech import SpokenAnswer, VoiceChoice, voice_choice
from omnistage.services.gateway.stages import HandedOver, StageError
from omnistage.services.gateway.validation import MediaPart, PlannedRequest, RequestLimits, check_context
from omnistage.v1 import common_pb2, omni_pb2

MIN_SAMPLE_RATE_HZ, MAX_SAMPLE_RATE_HZ = 8000, 48000
_END = object()


@dataclass(frozen=True)
class Interrupted:
    """A newer user turn began while an answer ran: the answer was closed (its stage streams cancelled)."""


@dataclass(frozen=True)
class ConverseLimits:
    """The gateway's Converse keys (docs/config.md) and the encoder's limits on one request; the
    defaults are the deploy file's (the config classes own them)."""

    max_turns: int = GatewayConfig.converse_max_turns
    max_turn_chars: int = GatewayConfig.converse_max_turn_chars
    max_turn_audio_bytes: int = GatewayConfig.converse_max_turn_audio_bytes
    # From the encoder's deploy-file keys: the longest clip and the items of one Encode request.
    max_audio_seconds: float = EncoderConfig.max_audio_seconds
    max_audio_items: int = EncoderConfig.max_items_per_request


@dataclass(frozen=True)
class ConversePlan:
    """A checked config: what every answer of the call uses."""

    request_id: str
    system_prompt: str
    sampling: common_pb2.SamplingParams
    voice: VoiceChoice | None  # None: the answers are text only
    history: tuple[Entry, ...]

    @property
    def speaks(self) -> bool:
        return self.voice is not None

    @property
    def outputs(self) -> frozenset[int]:
        spoken = {omni_pb2.MODALITY_AUDIO} if self.speaks else set()
        return frozenset({omni_pb2.MODALITY_TEXT, *spoken})


@dataclass(frozen=True)
class UserTurn:
    index: int
    entry: Entry
    ended_at: float  # when the turn was complete (TTFA counts from here)


@dataclass
class _Answer:
    """What an answer got to (kept when it is interrupted)."""

    text: list[str]
    tokens: int = 0
    prompt_tokens: int = 0  # the thinker's count, from its `started` (an interrupted answer has no finish)
    started: bool = False  # the thinker took the request (from then on, no retry with a shorter history)
    speech: SpokenAnswer | None = None
    token_ids: list[int] = field(default_factory=list)
    reason: int = common_pb2.FINISH_REASON_UNSPECIFIED

    def entry(self) -> Entry:
        """The answer for the history: a complete one (EOS / stop token, or max_tokens) also as its
        generated ids, without the stop token, so the next prompt repeats them exactly; one cut off
        (stop string, barge-in) as its text only (the ids would say more than the client saw)."""
        ids = self.token_ids
        if self.reason == common_pb2.FINISH_REASON_STOP:
            ids = ids[:-1]
        elif self.reason != common_pb2.FINISH_REASON_LENGTH:
            ids = []
        return Entry("assistant", "".join(self.text), token_ids=tuple(ids))


async def _first_of(step: asyncio.Future, *events: asyncio.Event) -> None:
    """Wait for `step` or any of `events`; `step` is cancelled (and awaited) when an event came first."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait({step, *waits}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        if not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        elif not step.cancelled():
            # A stage error that came with our own cancellation (the call's deadline) is read here,
            # not left to asyncio's "Task exception was never retrieved".
            step.exception()


def plan_converse(
    config: omni_pb2.GenerateRequest, limits: RequestLimits, default_system_prompt: str
) -> ConversePlan:
    """Check the call's config (the first message); errors name `config.<field>`."""
    request_id = config.request_id or uuid.uuid4().hex
    if not valid_request_id(request_id):
        raise InvalidRequest(
            f"config.request_id: must be printable and at most {MAX_REQUEST_ID_CHARS} characters"
        )
    for i, modality in enumerate(config.output_modalities):
        if modality not in (omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO):
            raise InvalidRequest(f"config.output_modalities[{i}]: Converse answers with text and speech only")
    # Empty: text and speech (a conversation speaks unless told otherwise); [MODALITY_TEXT]: text only.
    speaks = not config.output_modalities or omni_pb2.MODALITY_AUDIO in config.output_modalities
    if config.tools or config.tool_choice:
        raise InvalidRequest("config.tools: Converse takes no tools (use Generate)")
    if config.prompt or config.prompt_token_ids:
        raise InvalidRequest("config.prompt: Converse takes turns, not a raw prompt (use Generate)")
    if len(config.messages) > limits.max_messages:
        raise InvalidRequest(
            f"config.messages: {len(config.messages)} messages, at most {limits.max_messages} (max_messages)"
        )
    system_prompt = config.system_prompt
    seeded: list[Entry] = []
    for i, msg in enumerate(config.messages):
        where = f"config.messages[{i}]"
        if not msg.parts:
            raise InvalidRequest(f"{where}.parts: a message needs at least one part")
        if len(msg.parts) > limits.max_parts_per_message:
            raise InvalidRequest(
                f"{where}.parts: {len(msg.parts)} parts, at most {limits.max_parts_per_message} "
                "(max_parts_per_message)"
            )
        for j, part in enumerate(msg.parts):
            if part.WhichOneof("content") != "text" or not part.text:
                raise InvalidRequest(
                    f"{where}.parts[{j}]: the history of a Converse call takes non-empty text parts only"
                )
        text = "".join(part.text for part in msg.parts)
        if msg.role == omni_pb2.ROLE_SYSTEM:
            if i != 0 or system_prompt:
                raise InvalidRequest(
                    f"{where}.role: a system message may only be the first message, without system_prompt"
                )
            system_prompt = text
        elif msg.role in (omni_pb2.ROLE_USER, omni_pb2.ROLE_ASSISTANT):
            seeded.append(Entry("user" if msg.role == omni_pb2.ROLE_USER else "assistant", text))
        else:
            raise InvalidRequest(f"{where}.role: must be ROLE_SYSTEM, ROLE_USER or ROLE_ASSISTANT")
    chars = len(system_prompt) + sum(len(e.text) for e in seeded)
    if chars > limits.max_prompt_chars:
        raise InvalidRequest(
            f"config.messages: {chars} characters, the prompt limit is {limits.max_prompt_chars} "
            "(max_prompt_chars)"
        )
    try:
        check_sampling(config.sampling)
    except InvalidRequest as exc:
        raise InvalidRequest(f"config.{exc}") from None
    voice = voice_choice(config, "config.") if speaks else None
    system_prompt = system_prompt or default_system_prompt or DEFAULT_SYSTEM_PROMPT
    return ConversePlan(request_id, system_prompt, config.sampling, voice, tuple(seeded))


class Conversation:
    """One Omni.Converse call: its turns, each answered by the `pipeline` (thinker, talker, encoder)."""

    def __init__(self, pipeline: Pipeline, context: grpc.aio.ServicerContext, limits: ConverseLimits) -> None:
        self.pipeline = pipeline
        self.context = context
        self.limits = limits
        self.turns: asyncio.Queue = asyncio.Queue(2)  # complete user turns waiting for their answer
        self.turns_begun = 0
        self.newer_turn = asyncio.Event()  # a user turn began: the answer running may be interrupted
        # The client's stream broke or sent bad input: the call ends at once with this error, whatever
        # answer runs (each message is checked when it arrives, not after the answer before it).
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        self.cancelled_below = 0  # a `cancel` message: answers of the turns begun before it are not given
        self._requests: AsyncIterator[omni_pb2.ConverseRequest] | None = None

    async def events(
        self, requests: AsyncIterator[omni_pb2.ConverseRequest]
    ) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """The call: its config checked before it counts as in flight, admitted at the thinker's gate,
        then its answers."""
        plan = await self.open(requests)
        # Never possible (max_tokens past the thinker's context): INVALID_ARGUMENT before admission.
        try:
            check_context(plan.sampling, 1, self.pipeline.max_model_len)
        except InvalidRequest as exc:
            raise InvalidRequest(f"config.{exc}") from None
        self.pipeline.admit(self.context, ["thinker"])
        with self.pipeline.counted():
            async with contextlib.aclosing(self.run(plan)) as events:
                async for event in events:
                    yield event

    async def open(self, requests: AsyncIterator[omni_pb2.ConverseRequest]) -> ConversePlan:
        """Read and check the first message (the config); a spoken conversation needs the talker."""
        if self.pipeline.thinker is None:
            raise StageUnavailable("the 'thinker' stage is not available (gateway started degraded)")
        self._requests = aiter(requests)
        first = await anext(self._requests, None)
        if first is None:
            raise InvalidRequest("config: the stream ended before its first message")
        if first.WhichOneof("item") != "config":
            raise InvalidRequest("config: required in the first message")
        plan = plan_converse(first.config, self.pipeline.limits, self.pipeline.system_prompt)
        if plan.speaks and self.pipeline.speech is None:
            raise StageUnavailable(
                "Converse needs the 'talker' stage to speak, which is not deployed (ask for "
                "text only: config.output_modalities [MODALITY_TEXT])",
                retryable=False,
            )
        return plan

    async def run(self, plan: ConversePlan) -> AsyncIterator[omni_pb2.GenerateEvent]:
        history = History(plan.history, self.limits.max_turns)
        reader = asyncio.create_task(self._read_turns())
        try:
            while (turn := await self._next_turn()) is not _END:
                history.add(turn.entry)
                self.newer_turn.clear()
                answer = _Answer([])
                # Already superseded or cancelled: no answer.
                if self.turns_begun > turn.index + 1 or self.cancelled_below > turn.index:
                    yield self._interrupted(plan, turn.index, answer)
                    continue
                interrupted = False
                async with contextlib.aclosing(
                    self._interruptible(self._answer(plan, history, turn, answer))
                ) as events:
                    async for event in events:
                        if isinstance(event, Interrupted):
                            interrupted = True
                            break
                        event.turn = turn.index
                        yield event
                        if event.HasField(
                            "finish"
                        ):  # answered: a turn begun now is the next one, no barge-in
                            break
                history.add(answer.entry())
                if interrupted:
                    yield self._interrupted(plan, turn.index, answer)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    # -- the client's turns ---------------------------------------------------------------------

    async def _read_turns(self) -> None:
        try:
            await self._collect_turns()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - bad input or a broken stream ends the call: handed over
            self.failure = exc
            self.failed.set()
            return
        await self.turns.put(_END)

    async def _next_turn(self) -> UserTurn | object:
        """The next complete user turn (_END once the client half-closed); the reader's error first."""
        turn = asyncio.ensure_future(self.turns.get())
        await _first_of(turn, self.failed)
        if self.failure is not None:
            if turn.done() and not turn.cancelled():  # a turn taken as the failure came: put back
                self.turns.put_nowait(turn.result())
            raise self.failure
        return turn.result()

    def _begin_turn(self) -> int:
        self.turns_begun += 1
        self.newer_turn.set()
        return self.turns_begun - 1

    async def _collect_turns(self) -> None:
        limits = self.limits
        pcm, rate, index = bytearray(), 0, -1
        async for message in self._requests:
            kind = message.WhichOneof("item")
            if kind == "config":
                raise InvalidRequest("config: only the first message may carry it")
            if kind == "text":
                if pcm:
                    raise InvalidRequest("text: a spoken turn is still open (send end_of_turn first)")
                if not message.text or len(message.text) > limits.max_turn_chars:
                    raise InvalidRequest(
                        f"text: {len(message.text)} characters, a text turn takes 1 to "
                        f"{limits.max_turn_chars} (converse_max_turn_chars)"
                    )
                index = self._begin_turn()
                await self.turns.put(
                    UserTurn(index, Entry("user", message.text, index=index), time.monotonic())
                )
            elif kind == "audio":
                chunk = message.audio
                if not pcm:
                    if self.pipeline.media is None:
                        raise StageUnavailable(
                            "audio: spoken turns need the 'encoder' stage, which is not deployed",
                            retryable=False,
                        )
                    if not MIN_SAMPLE_RATE_HZ <= chunk.sample_rate_hz <= MAX_SAMPLE_RATE_HZ:
                        raise InvalidRequest(
                            f"audio.sample_rate_hz: {chunk.sample_rate_hz}, expected "
                            f"{MIN_SAMPLE_RATE_HZ} to {MAX_SAMPLE_RATE_HZ}"
                        )
                    rate, index = chunk.sample_rate_hz, self._begin_turn()
                elif chunk.sample_rate_hz != rate:
                    raise InvalidRequest(
                        f"audio.sample_rate_hz: {chunk.sample_rate_hz}, the turn began at {rate}"
                    )
                pcm += chunk.pcm16
                self._check_audio(pcm, rate)
            elif kind == "cancel" and message.cancel:
                self.cancelled_below = self.turns_begun
                self.newer_turn.set()
            elif kind == "end_of_turn" and message.end_of_turn:
                if not pcm:
                    raise InvalidRequest("end_of_turn: no audio before it (a text turn needs none)")
                await self._spoken_turn(index, pcm, rate)
                pcm = bytearray()
            else:
                raise InvalidRequest(
                    "ConverseRequest: empty message (set text, audio, end_of_turn or cancel)"
                )
        if pcm:  # the client half-closed in the middle of a spoken turn: that turn is over
            await self._spoken_turn(index, pcm, rate)

    def _check_audio(self, pcm: bytearray, rate: int) -> None:
        limits = self.limits
        if len(pcm) > limits.max_turn_audio_bytes:
            raise InvalidRequest(
                f"audio.pcm16: the spoken turn passes {limits.max_turn_audio_bytes} bytes "
                "(converse_max_turn_audio_bytes)"
            )
        if len(pcm) / 2 / rate > limits.max_audio_seconds:
            raise InvalidRequest(
                f"audio.pcm16: the spoken turn passes the encoder's max_audio_seconds "
                f"({limits.max_audio_seconds:g} s)"
            )

    async def _spoken_turn(self, index: int, pcm: bytearray, rate: int) -> None:
        if len(pcm) % 2:
            raise InvalidRequest(f"audio.pcm16: the turn has {len(pcm)} bytes, PCM16 needs an even number")
        entry = Entry("user", wav=wav_of(bytes(pcm), rate), index=index)
        await self.turns.put(UserTurn(index, entry, time.monotonic()))

    # -- answers --------------------------------------------------------------------------------

    async def _interruptible(
        self, events: AsyncIterator[omni_pb2.GenerateEvent]
    ) -> AsyncIterator[omni_pb2.GenerateEvent | Interrupted]:
        """The answer's events until a newer user turn begins; then Interrupted, after the answer was
        closed (which cancels its thinker and talker streams)."""
        try:
            while True:
                step = asyncio.ensure_future(anext(events, _END))
                await _first_of(step, self.newer_turn, self.failed)
                if self.failure is not None:  # bad input: the call ends now (the answer is closed)
                    raise self.failure
                if step.cancelled():
                    yield Interrupted()
                    return
                event = step.result()
                if event is _END:
                    return
                yield event
        finally:
            await events.aclose()

    async def _answer(
        self, plan: ConversePlan, history: History, turn: UserTurn, answer: _Answer
    ) -> AsyncIterator[omni_pb2.GenerateEvent]:
        while True:
            try:
                # Closed here when this answer is (its Finish passed on, or a barge-in): its stage streams
                # end now, not when asyncio's finalizer gets to the generator in a task of its own.
                async with contextlib.aclosing(self._attempt(plan, history, turn, answer)) as events:
                    async for event in events:
                        yield event
                return
            except StageError as exc:
                # The thinker refused the prompt: the history outgrew its context. Forget the oldest
                # exchange and ask again (the refusal came before `started`: nothing was sent yet). A
                # max_tokens above max_model_len is no matter of history: it fails the call.
                too_long = (
                    exc.code == grpc.StatusCode.INVALID_ARGUMENT
                    and "max_model_len" in str(exc)
                    and "sampling.max_tokens:" not in str(exc)
                )
                if not (too_long and not answer.started and history.forget_oldest()):
                    raise

    async def _attempt(
        self, plan: ConversePlan, history: History, turn: UserTurn, answer: _Answer
    ) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """One answer by the pipeline from the history's window (its spoken turns encoded again: the
        window changes from turn to turn), kept in `answer` as it streams."""
        pipeline = self.pipeline
        max_media_bytes = pipeline.media.max_media_bytes if pipeline.media is not None else 0
        window = history.window(
            plan.system_prompt, pipeline.limits.max_prompt_chars, max_media_bytes, self.limits.max_audio_items
        )
        parts = tuple(MediaPart(where, "audio", omni_pb2.Media(data=wav)) for where, wav in window.audio)
        request = PlannedRequest(
            plan.request_id, window.turns, plan.system_prompt, plan.sampling, plan.outputs, parts
        )
        # Not through the encoder's gate: a conversation is admitted once, at the thinker's.
        media = EncodedMedia(pipeline, request, {}, self.context, gated=False)
        events = pipeline.answer(request, media, self.context, plan.voice, turn.ended_at, "config.")
        try:
            async with contextlib.aclosing(events) as stream:  # an interrupted answer's stage streams end now
                async for event in stream:
                    if isinstance(event, HandedOver):
                        answer.started, answer.speech = True, event.speech
                        answer.prompt_tokens = event.prompt_tokens
                        continue
                    if event.HasField("text"):
                        answer.text.append(event.text.text)
                        answer.tokens += len(event.text.token_ids)
                        answer.token_ids += event.text.token_ids
                    elif event.HasField("finish"):
                        answer.reason = event.finish.reason
                    yield event
        finally:
            media.release()

    def _interrupted(self, plan: ConversePlan, index: int, answer: _Answer) -> omni_pb2.GenerateEvent:
        message = f"interrupted by user turn {index + 1}"
        if self.turns_begun <= index + 1:  # no newer turn: a `cancel` message
            message = "cancelled by the client"
        finish = omni_pb2.Finish(
            reason=common_pb2.FINISH_REASON_INTERRUPTED,
            message=message,
            usage=common_pb2.Usage(prompt_tokens=answer.prompt_tokens, completion_tokens=answer.tokens),
        )
        if plan.speaks:  # a text-only conversation has no AudioStatus: no speech was asked for
            status = omni_pb2.AudioStatus(code="CANCELLED", message=message)
            if answer.speech is not None:
                status = answer.speech.interrupted(message)
            finish.message = status.message
            finish.audio.CopyFrom(status)
        return omni_pb2.GenerateEvent(request_id=plan.request_id, turn=index, finish=finish)
