"""Omni.Converse: one call, many turns; each user turn is answered by a RequestRun with text and speech
(or with text only, when the config's output_modalities is [MODALITY_TEXT]: then no talker is needed).

The client's messages are read by one task as they arrive (each checked then: bad input ends the call at
once, whatever answer runs). A newer user turn, or the client's `cancel`, cancels the run answering now
(its thinker and talker calls end at once; the turn's Finish says INTERRUPTED): a barge-in is one call,
with no task or future per streamed event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from omnistage.common import metrics
from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable
from omnistage.services.gateway.converse_plan import (
    MAX_SAMPLE_RATE_HZ,
    MIN_SAMPLE_RATE_HZ,
    ConverseLimits,
    ConversePlan,
    plan_converse,
)
from omnistage.services.gateway.history import Entry, History
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.run import RequestRun
from omnistage.services.gateway.stages import StageError
from omnistage.services.gateway.ticket import Ticket
from omnistage.services.gateway.validation import MediaPart, PlannedRequest, check_context
from omnistage.v1 import common_pb2, omni_pb2

__all__ = ["Conversation", "ConverseLimits", "UserTurn"]
_END, _FAILED = object(), object()  # the turns' ends: the client half-closed, or its stream failed
_TURN_SECONDS = metrics.histogram(
    "gateway_turn_seconds",
    "A Converse user turn from its end (its last message read) to its media ready for the thinker "
    "(phase media: encoded, or found kept or encoded ahead; turns with media), to its first text "
    "sent (phase first_text) and to its first audio sent (phase first_audio; spoken answers), by "
    "turn: the call's first, or a later one",
    ("phase", "turn"),
)


@dataclass(frozen=True)
class UserTurn:
    index: int
    entry: Entry
    ended_at: float  # when the turn was complete (TTFA counts from here)


@dataclass
class _Answer:
    """What the client was sent of an answer (kept when it is interrupted)."""

    text: list[str]
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    reason: int = common_pb2.FINISH_REASON_UNSPECIFIED

    def sent(self, event: omni_pb2.GenerateEvent) -> None:
        if event.HasField("text"):
            self.text.append(event.text.text)
            self.tokens += len(event.text.token_ids)
            self.token_ids += event.text.token_ids
        elif event.HasField("finish"):
            self.reason = event.finish.reason

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


class Conversation:
    """One Omni.Converse call: its turns, each answered by the `pipeline` (thinker, talker, encoder)."""

    def __init__(self, pipeline: Pipeline, context: grpc.aio.ServicerContext, limits: ConverseLimits) -> None:
        self.pipeline = pipeline
        self.context = context
        self.limits = limits
        self.turns: asyncio.Queue = asyncio.Queue(2)  # complete user turns waiting for their answer
        self.turns_begun = 0
        self.answering: tuple[int, RequestRun] | None = None  # the turn answered now, and its run
        # The client's stream broke or sent bad input: the call ends at once with this error.
        self.failure: BaseException | None = None
        self.cancelled_below = 0  # a `cancel` message: answers of the turns begun before it are not given
        self._requests: AsyncIterator[omni_pb2.ConverseRequest] | None = None

    async def events(
        self, requests: AsyncIterator[omni_pb2.ConverseRequest]
    ) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """The call: its config checked before it counts as in flight, admitted at the thinker's gate,
        then one run per user turn, its events as they come."""
        plan = await self.open(requests)
        ticket = self.pipeline.admission.admit_conversation(self.context.time_remaining())
        history = History(plan.history, self.limits.max_turns)
        reader = asyncio.create_task(self._read_turns())
        try:
            while (turn := await self._next_turn()) is not _END:
                history.add(turn.entry)
                answer, run = _Answer([]), self._start(plan, ticket, history, turn)
                if run is not None:
                    async with run, contextlib.aclosing(run.events()) as events:
                        async for event in events:
                            answer.sent(event)
                            event.turn = turn.index
                            yield event
                    self.answering = None
                    self._timed(turn, run)
                    if self.failure is not None:  # bad input: the call ends now (the answer was cancelled)
                        raise self.failure
                history.add(answer.entry())
                if run is None or run.cancelled:
                    yield self._interrupted(plan, turn.index, answer, run)
        finally:
            ticket.release()
            self.pipeline.conversation_ended(plan.request_id)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def open(self, requests: AsyncIterator[omni_pb2.ConverseRequest]) -> ConversePlan:
        """Read and check the first message (the config); a spoken conversation needs the talker. Never
        possible (max_tokens past the thinker's context): INVALID_ARGUMENT before admission."""
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
        try:
            check_context(plan.sampling, 1, self.pipeline.admission.max_model_len)
        except InvalidRequest as exc:
            raise InvalidRequest(f"config.{exc}") from None
        return plan

    # -- answers --------------------------------------------------------------------------------

    def _timed(self, turn: UserTurn, run: RequestRun) -> None:
        """The turn's phases in gateway_turn_seconds, the call's first turn apart from the later ones
        (its first audio is also in gateway_ttfa_seconds, with Generate's)."""
        which = "first" if turn.index == 0 else "later"
        audio = run.audio
        first_audio = audio.time_to_first_audio_ms / 1000 if audio is not None and audio.samples else None
        for phase, seconds in (
            ("media", None if run.media_at is None else run.media_at - turn.ended_at),
            ("first_text", None if run.first_text_at is None else run.first_text_at - turn.ended_at),
            ("first_audio", first_audio),
        ):
            if seconds is not None:
                _TURN_SECONDS.labels(self.pipeline.service, phase, which).observe(seconds)

    def _start(
        self, plan: ConversePlan, ticket: Ticket, history: History, turn: UserTurn
    ) -> RequestRun | None:
        """The run answering `turn`; None when a newer turn (or a `cancel`) came first."""
        if self.turns_begun > turn.index + 1 or self.cancelled_below > turn.index:
            return None
        run = RequestRun(plan.request_id, self.pipeline.buffer_events, turn.ended_at)
        run.start(self._answer(run, ticket, plan, history), "answer")
        self.answering = (turn.index, run)
        return run

    async def _answer(self, run: RequestRun, ticket: Ticket, plan: ConversePlan, history: History) -> None:
        """The turn's answer from the history's window (its spoken turns encoded again: the window
        changes from turn to turn). A prompt the thinker refuses as past its context (before it took
        the request) is asked again without the oldest exchange."""
        while True:
            try:
                finish = await self.pipeline.answer_turn(
                    run, ticket, self._request(plan, history), plan.voice, self.context.time_remaining
                )
            except StageError as exc:
                if not (exc.context_overflow and not run.handed_over and history.forget_oldest()):
                    raise
                continue
            await run.finish(finish)
            return

    def _request(self, plan: ConversePlan, history: History) -> PlannedRequest:
        media = self.pipeline.media
        window = history.window(
            plan.system_prompt,
            self.pipeline.limits.max_prompt_chars,
            media.max_media_bytes if media is not None else 0,
            self.limits.max_audio_items,
        )
        parts = tuple(
            MediaPart(where, "audio", omni_pb2.Media(data=e.pcm16), pcm_rate_hz=e.sample_rate_hz)
            for where, e in window.spoken()
        )
        return PlannedRequest(
            plan.request_id, window.turns, plan.system_prompt, plan.sampling, plan.outputs, parts
        )

    def _interrupted(
        self, plan: ConversePlan, index: int, answer: _Answer, run: RequestRun | None
    ) -> omni_pb2.GenerateEvent:
        message = self._interruption(index)
        prompt_tokens = run.prompt_tokens if run is not None else 0
        finish = omni_pb2.Finish(
            reason=common_pb2.FINISH_REASON_INTERRUPTED,
            message=message,
            usage=common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=answer.tokens),
        )
        if plan.speaks:  # a text-only conversation has no AudioStatus: no speech was asked for
            status = run.audio if run is not None and run.audio is not None else None
            status = status or omni_pb2.AudioStatus(code="CANCELLED", message=message)
            finish.message = status.message
            finish.audio.CopyFrom(status)
        return omni_pb2.GenerateEvent(request_id=plan.request_id, turn=index, finish=finish)

    def _interruption(self, index: int) -> str:
        """Why the answer of turn `index` was cut off: a newer turn, else the client's `cancel`."""
        return (
            f"interrupted by user turn {index + 1}"
            if self.turns_begun > index + 1
            else "cancelled by the client"
        )

    # -- the client's turns ---------------------------------------------------------------------

    async def _read_turns(self) -> None:
        try:
            await self._collect_turns()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - bad input or a broken stream ends the call: handed over
            self.failure = exc
            self._interrupt("the call failed")
            while not self.turns.empty():  # the call fails: the turns waiting will not be answered
                self.turns.get_nowait()
            self.turns.put_nowait(_FAILED)
            return
        await self.turns.put(_END)

    async def _next_turn(self) -> UserTurn | object:
        """The next complete user turn (_END once the client half-closed); the reader's error first."""
        turn = await self.turns.get()
        if turn is _FAILED:
            raise self.failure
        return turn

    def _begin_turn(self) -> int:
        self.turns_begun += 1
        if self.answering is not None:
            self._interrupt(self._interruption(self.answering[0]))
        return self.turns_begun - 1

    def _interrupt(self, reason: str) -> None:
        """Cancel the run answering now (a no-op once its Finish is on its way)."""
        if self.answering is not None:
            self.answering[1].cancel(reason)

    async def _collect_turns(self) -> None:
        pcm, rate, index = bytearray(), 0, -1
        async for message in self._requests:
            kind = message.WhichOneof("item")
            if kind == "config":
                raise InvalidRequest("config: only the first message may carry it")
            if kind == "text":
                if pcm:
                    raise InvalidRequest("text: a spoken turn is still open (send end_of_turn first)")
                self._check_text(message.text)
                index = self._begin_turn()
                await self.turns.put(
                    UserTurn(index, Entry("user", message.text, index=index), time.monotonic())
                )
            elif kind == "audio":
                rate, index = self._audio(message.audio, pcm, rate, index)
            elif kind == "cancel" and message.cancel:
                self.cancelled_below = self.turns_begun
                self._interrupt("cancelled by the client")
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

    def _check_text(self, text: str) -> None:
        if not text or len(text) > self.limits.max_turn_chars:
            raise InvalidRequest(
                f"text: {len(text)} characters, a text turn takes 1 to "
                f"{self.limits.max_turn_chars} (converse_max_turn_chars)"
            )

    def _audio(self, chunk: omni_pb2.AudioChunk, pcm: bytearray, rate: int, index: int) -> tuple[int, int]:
        """One chunk of a spoken turn into `pcm` (its first begins the turn); (rate, turn index)."""
        if not pcm:
            if self.pipeline.media is None:
                raise StageUnavailable(
                    "audio: spoken turns need the 'encoder' stage, which is not deployed", retryable=False
                )
            if not MIN_SAMPLE_RATE_HZ <= chunk.sample_rate_hz <= MAX_SAMPLE_RATE_HZ:
                raise InvalidRequest(
                    f"audio.sample_rate_hz: {chunk.sample_rate_hz}, expected "
                    f"{MIN_SAMPLE_RATE_HZ} to {MAX_SAMPLE_RATE_HZ}"
                )
            rate, index = chunk.sample_rate_hz, self._begin_turn()
        elif chunk.sample_rate_hz != rate:
            raise InvalidRequest(f"audio.sample_rate_hz: {chunk.sample_rate_hz}, the turn began at {rate}")
        pcm += chunk.pcm16
        self._check_audio(pcm, rate)
        return rate, index

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
        entry = Entry("user", pcm16=bytes(pcm), sample_rate_hz=rate, index=index)
        await self.turns.put(UserTurn(index, entry, time.monotonic()))
