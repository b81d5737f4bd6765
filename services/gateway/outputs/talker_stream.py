"""One spoken answer's speech: the answer's text goes to a talker (a Talker.Speak call: speak_call.py) as
the thinker decodes it, the audio comes back into the answer's run, interleaved with the text.

The text never waits for a talker stream: a stream free now is opened at the thinker's `started` and
the first text waits (at most `talker_start_wait_s`) for the talker to accept the voice, so that a voice
it refuses fails the request naming the field; with every stream busy, the text goes out at once and
the audio joins when a stream frees (within `talker_stream_wait_s`, the talker then speaking the text
so far), else the answer is text only and its AudioStatus says RESOURCE_EXHAUSTED.

A talker replica lost under the speech (its watch took it out, the call broke, the talker said
UNAVAILABLE) does not end it: the speech moves to a replica that is up, its stream taken ahead of the
answers whose audio has not begun (within `talker_stream_wait_s`), and goes on from the first segment
the lost talker did not finish (SegmentDone.text_end: that segment starts again, under the next segment
index). No replica up, or no stream in time: the AudioStatus names the replica lost and why the speech
could not go on. The streams of other answers are never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import grpc
from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.errors import (
    ERROR_REASON_KEY,
    NOTHING_TO_SPEAK,
    RETRY_PUSHBACK_KEY,
    InvalidRequest,
)
from omnistage.services.gateway.admission import Slot
from omnistage.services.gateway.outputs.speak_call import SpeakCall
from omnistage.services.gateway.outputs.stream_choice import NoStream, Speech, StreamChoice
from omnistage.services.gateway.stages import TalkerClient, broken_stream, take_end
from omnistage.v1 import common_pb2, omni_pb2, talker_pb2

if TYPE_CHECKING:
    from omnistage.services.gateway.answer import Answer

_log = logging.getLogger(__name__)

_SPOKEN_REASONS = {
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_STOP_STRING,
}


class TalkerStream:
    """The speech of one answer (an AnswerSink: outputs/__init__.py), one Speak call at a time. Its
    `status` says what became of it; the first reason the speech stopped short is the one it keeps."""

    def __init__(self, stage: Speech, answer: Answer, config: talker_pb2.SpeakConfig) -> None:
        self.stage = stage
        self.limits = stage.limits
        self.answer = answer
        self.run = answer.run
        self.config = config
        self.talker = stage.replicas.first  # the replica it speaks on (picked when a stream is free)
        self.status = omni_pb2.AudioStatus()
        self.accepted = asyncio.Event()  # the talker's verdict, or the text goes on without waiting for it
        self.released = False  # text has gone to the client: a refusal now ends only the speech
        self.finished = False  # every character was spoken (the talker said `finished`)
        self.call: SpeakCall | None = None  # the call speaking now
        self.task: asyncio.Task | None = None
        self._settled = False  # the status is final (and counted in the metrics)
        self._text: list[str] = []  # the answer's text so far: a moved speech sends it again from its place
        self._chars = 0
        self._truncated = False
        self._text_over = False
        self._stopped = False  # stop(): the speech ends here, the status says why
        self._waiting = False  # the speech waits for a stream (stop() ends the wait)
        self._chunks = 0
        self._segment = 0  # the client's segment index of the last chunk sent
        self._base = 0  # the client's segment index of the call's segment 0
        self._next_segment = 0  # the first client segment index not used yet
        self._spoken_to = 0  # characters of the text that talkers spoke to the end of a segment
        self.choice = StreamChoice(stage, answer.ticket)  # its streams, and the replicas lost under it

    # -- the answer's side (AnswerSink) ----------------------------------------------------------

    def started(self) -> None:
        self.run.audio = self.status  # the run counts the audio it sends
        self.task = self.run.start(self._speak(), "speech")

    async def text(self, text: str) -> None:
        if not self.released:  # the first text: wait (bounded) for the talker's verdict on the voice
            with contextlib.suppress(TimeoutError):
                await within(self.accepted.wait(), self.limits.start_wait_s)
            self.released = True
        room = self.limits.max_text_chars - self._chars
        if self._text_over or not text:
            return
        if len(text) > room:
            text, self._truncated = text[:room], True
        self._chars += len(text)
        self._text.append(text)
        if self.call is not None:
            self.call.send(text)
        if self._truncated:
            self._end_text()

    async def end(self, finish: omni_pb2.GenerateEvent) -> None:
        if finish.finish.reason in _SPOKEN_REASONS:
            self._end_text()
        else:
            reason = common_pb2.FinishReason.Name(finish.finish.reason)
            self.stop("CANCELLED", f"the answer ended with {reason}: not spoken to its end")
        if self.task is not None:  # its end, however it ended (cancelled before it began, too)
            await asyncio.wait({self.task})
        self._settle()  # once (the speech's task settles it when it ran)
        finish.finish.audio.CopyFrom(self.status)

    def stop(self, code: str, message: str) -> None:
        """Stop speaking (the answer was aborted): cancel the call, or the wait for a stream."""
        self.fail(code, message)
        self._stopped = True
        if self.call is not None:
            self.call.cancel()
        elif self._waiting and self.task is not None:
            self.task.cancel()

    def fail(self, code: str, message: str, retry_after_ms: int = 0) -> None:
        if not self.status.code:
            self.status.code, self.status.message, self.status.retry_after_ms = code, message, retry_after_ms

    # -- the speech task ---------------------------------------------------------------------------

    async def _speak(self) -> None:
        """Speak on a stream; while a replica is lost under the speech, go on on another."""
        try:
            lost = ""
            while not self._stopped and (slot := await self._stream(lost)) is not None:
                if not (lost := await self._speak_on(slot)):
                    break
            if self._chunks:  # however it ended, the audio sent ends with a `last` chunk
                chunk = omni_pb2.AudioChunk(
                    sample_rate_hz=self.status.sample_rate_hz, segment_index=self._segment, last=True
                )
                await self.run.emit(omni_pb2.GenerateEvent(request_id=self.run.request_id, audio=chunk))
        except asyncio.CancelledError:
            self.fail("CANCELLED", self.run.cancelled or "the answer was closed")
            raise
        finally:
            self.accepted.set()
            self._settle()

    async def _stream(self, lost: str) -> Slot | None:
        """A talker stream for the speech (stream_choice.py; the text goes on meanwhile), on the replica
        it then speaks on; None, with the status set, when there is none."""
        if not self.stage.gate.has_room():
            self.accepted.set()  # the text does not wait for a stream
        self._waiting = True
        try:
            got = await self.choice.take(lost, self.talker)
        finally:
            self._waiting = False
        if isinstance(got, NoStream):
            self.fail(got.code, got.message, got.retry_after_ms)
            return None
        slot, talker = got
        if lost:
            self._moved(lost, talker)
        self.talker = talker
        return slot

    async def _speak_on(self, slot: Slot) -> str:
        """Speak on `self.talker` (its stream `slot`, held until the call is over) from the first
        character no talker spoke to a segment's end; '' once the speech ended, else how the replica
        was lost (the speech moves on)."""
        start = self._spoken_to
        try:
            call = SpeakCall(
                self.talker,
                self.config,
                start,
                "".join(self._text)[start:],
                self._text_over,
                self.limits.idle_timeout_s,
                self.answer.remaining(),
            )
        except BaseException:
            slot.release()
            raise
        call.call.add_done_callback(lambda _call: slot.release())  # after the replica's credit
        self.call = call
        try:
            return await self._read(call)
        finally:
            self.call = None
            call.close()  # grpc's task reading the requests ends too

    async def _read(self, call: SpeakCall) -> str:
        """The call's speech into the run; '' once the speech ended, else how its replica was lost when
        the speech moves on."""
        lost = ""
        try:
            await self._read_speech(call)
        except grpc.aio.AioRpcError as exc:
            if not (lost := self._lost(exc)) and (refusal := self._refused_or_failed(exc)) is not None:
                self.run.fail(refusal)
        except TimeoutError:  # silence once the text was over (the read was cancelled: so is the call)
            self.fail(
                "DEADLINE_EXCEEDED",
                f"{self.talker.name}: no speech for {self.limits.idle_timeout_s:g}s (gateway.talker_idle_timeout_s)",
            )
        except asyncio.CancelledError:
            if self.talker.lost_call():  # the talker went down under the call: the text goes on
                lost = self.talker.unavailable().args[0]
            elif asyncio.current_task().cancelling() or not call.stopped:
                raise  # the speech task was cancelled (the answer is closing), not only the call
        finally:
            call.verdict.set()
            self.accepted.set()
        return lost if lost and self._moves_on(lost) else ""

    async def _read_speech(self, call: SpeakCall) -> None:
        """The talker's events into the run; once the text is over, silence from the talker (not a slow
        client) past `talker_idle_timeout_s` ends the call (TimeoutError)."""
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                self.fail("UNAVAILABLE", f"{call.talker.name}: the stream ended before it finished")
                return
            if await self._on_response(response, call):
                await take_end(call.call)  # the last event: its own end (OK), not a cancel on close
                return

    async def _on_response(self, response: talker_pb2.SpeakResponse, call: SpeakCall) -> bool:
        """One event of the talker; True at its last (`finished`). Its segment indices follow those of
        the calls before it (`_base`)."""
        kind = response.WhichOneof("event")
        if kind == "started":
            self.status.voice = response.started.voice
            self.status.sample_rate_hz = response.started.sample_rate_hz
            call.verdict.set()
            self.accepted.set()
        elif kind == "audio":
            a = response.audio
            self._chunks += 1
            self._segment = self._base + a.segment_index
            self._next_segment = max(self._next_segment, self._segment + 1)
            chunk = omni_pb2.AudioChunk(
                pcm16=a.pcm16, sample_rate_hz=self.status.sample_rate_hz, segment_index=self._segment
            )
            await self.run.emit(omni_pb2.GenerateEvent(request_id=self.run.request_id, audio=chunk))
        elif kind == "segment_done":
            done = response.segment_done
            self.status.segments += 1
            self._next_segment = max(self._next_segment, self._base + done.segment_index + 1)
            if done.text_end:  # 0: not known (a moved speech then starts again where this call started)
                self._spoken_to = max(self._spoken_to, call.start + done.text_end)
        elif kind == "finished":
            self.finished = True
            if self._truncated:
                self.fail(
                    "OUT_OF_RANGE",
                    f"the answer passed the talker's max_text_chars ({self.limits.max_text_chars} "
                    "characters): spoken up to there",
                )
            return True
        return False

    def _end_text(self) -> None:
        if not self._text_over:
            self._text_over = True
            if self.call is not None:
                self.call.end_text()

    # -- a replica lost under the speech ------------------------------------------------------------

    def _lost(self, exc: grpc.aio.AioRpcError) -> str:
        """How the call's replica was lost, when its error says it was ('' otherwise): its watch took it
        out, the connection broke, or the talker is UNAVAILABLE (its watch takes it out now, so that no
        new answer speaks there)."""
        details = exc.details() or ""
        if not self.talker.up and exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
            return self.talker.unavailable().args[0]
        if not (broken_stream(exc) or exc.code() == grpc.StatusCode.UNAVAILABLE):
            return ""
        self.talker.unreachable(details)
        return f"{self.talker.name}: {f'the stream broke ({details})' if broken_stream(exc) else details}"

    def _moves_on(self, lost: str) -> bool:
        """Whether the speech goes on after its replica was `lost` (from its first segment not spoken to
        its end, under the next segment index): not when it was stopped, or was spoken to its end."""
        if self._stopped:
            return False
        if self._text_over and self._spoken_to >= self._chars:  # only the `finished` was lost
            self.finished = True
            return False
        self.choice.lost.append(self.talker.name)
        self._base = self._next_segment
        return True

    def _moved(self, lost: str, talker: TalkerClient) -> None:
        self.stage.moved(self.choice.lost[-1])
        _log.warning(
            "request %s: %s (after %d segments); its speech goes on on %s from character %d",
            self.run.request_id,
            lost,
            self.status.segments,
            talker.name,
            self._spoken_to,
        )

    # -- the talker's refusals and the outcome -----------------------------------------------------

    def _refused_or_failed(self, exc: grpc.aio.AioRpcError) -> InvalidRequest | None:
        """Set the status from the talker's error; the client's error when it refused the request's voice
        before any text was let through (then the request fails as a whole, naming the field)."""
        details = exc.details() or ""
        trailing = dict(exc.trailing_metadata() or ())
        if (
            str(trailing.get(ERROR_REASON_KEY, "")) == NOTHING_TO_SPEAK
            and self.choice.lost
            and self.status.segments
        ):
            self.finished = True  # a moved speech whose rest had nothing to speak: it is complete
            return None
        pushback = str(trailing.get(RETRY_PUSHBACK_KEY, "0"))
        self.fail(
            exc.code().name, f"{self.talker.name}: {details}", int(pushback) if pushback.isdigit() else 0
        )
        if (
            exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            and details.startswith("config.")
            and not self.status.voice
            and not self.released
        ):
            return InvalidRequest(self.answer.where + details.removeprefix("config."))
        return None

    def _settle(self) -> None:
        if self._settled:
            return
        self._settled = True
        status = self.status
        if self.finished and not status.code:
            status.outcome = omni_pb2.AUDIO_OUTCOME_COMPLETE
        else:
            status.outcome = omni_pb2.AUDIO_OUTCOME_PARTIAL if status.samples else omni_pb2.AUDIO_OUTCOME_NONE
            if not status.code:
                status.code, status.message = "UNAVAILABLE", f"{self.talker.name}: the speech did not finish"
        self.stage.observe(status)
