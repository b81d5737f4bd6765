"""One spoken answer's Talker.Speak call: the answer's text goes in as the thinker decodes it, the audio
comes back into the answer's run, interleaved with the text.

The text never waits for a talker stream: a stream free now is opened at the thinker's `started` and
the first text waits (at most `talker_start_wait_s`) for the talker to accept the voice, so that a voice
it refuses fails the request naming the field; with every stream busy, the text goes out at once and
the audio joins when a stream frees (within `talker_stream_wait_s`, the talker then speaking the text
so far), else the answer is text only and its AudioStatus says RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.errors import RETRY_PUSHBACK_KEY, DeadlineExceeded, InvalidRequest, Overloaded
from omnistage.services.gateway.admission import Slot, StageGate
from omnistage.services.gateway.replicas import Replicas, in_flight_share
from omnistage.services.gateway.stages import TalkerClient, broken_stream, take_end
from omnistage.v1 import common_pb2, omni_pb2, talker_pb2

if TYPE_CHECKING:
    from omnistage.services.gateway.answer import Answer

# Pushback a client gets when this gateway holds all the talker's streams (the talker's own).
NO_CREDIT_RETRY_MS = 500
_SPOKEN_REASONS = {
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_STOP_STRING,
}
_END_OF_TEXT, _STOP = object(), object()  # the requests' ends: with end_of_text, or without (stopped)

_talker_load = in_flight_share(lambda t: t.max_streams)


class Speech(Protocol):
    """What a stream needs of the talker's side of the gateway (outputs/talker.py's SpeechStage)."""

    kind: str
    limits: Any  # SpeechLimits
    replicas: Replicas[TalkerClient]
    gate: StageGate

    def observe(self, status: omni_pb2.AudioStatus) -> None: ...


class _Requests:
    """What the Speak call sends: the config, then (once the talker accepted it) the text as it came,
    end_of_text last. Its only reader is grpc's task for the call; the stream ends it on every path
    (`_STOP`), so that task ends whether the call is live or over (a class, not an async generator: grpc
    leaves an iterator it stops reading where it is, and an async generator left so is finalized later)."""

    def __init__(self, config: talker_pb2.SpeakConfig, verdict: asyncio.Event) -> None:
        self.config: talker_pb2.SpeakConfig | None = config
        self.verdict = verdict
        self.texts: asyncio.Queue = asyncio.Queue()  # bounded by the talker's max_text_chars
        self.over = False

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> talker_pb2.SpeakRequest:
        if self.config is not None:
            config, self.config = self.config, None
            return talker_pb2.SpeakRequest(config=config)
        # No text before the talker's verdict on the config: a write racing its refusal makes grpc
        # report INTERNAL "Internal error from Core" instead of the talker's status.
        await self.verdict.wait()
        if self.over:
            raise StopAsyncIteration
        items = [await self.texts.get()]
        while not self.texts.empty():
            items.append(self.texts.get_nowait())
        self.over = _STOP in items or _END_OF_TEXT in items
        if _STOP in items:
            raise StopAsyncIteration
        text = "".join(i for i in items if isinstance(i, str))
        return talker_pb2.SpeakRequest(text=text, end_of_text=_END_OF_TEXT in items)


class TalkerStream:
    """The speech of one answer (an AnswerSink: outputs/__init__.py). Its `status` says what became of
    it; the first reason the speech stopped short is the one it keeps."""

    def __init__(self, stage: Speech, answer: Answer, config: talker_pb2.SpeakConfig) -> None:
        self.stage = stage
        self.limits = stage.limits
        self.answer = answer
        self.run = answer.run
        self.talker = stage.replicas.first  # the replica it speaks on (picked when a stream is free)
        self.status = omni_pb2.AudioStatus()
        self.verdict = asyncio.Event()  # the talker started the call, or the call is over
        self.accepted = asyncio.Event()  # the verdict, or the text goes on without waiting for it
        self.requests = _Requests(config, self.verdict)
        self.released = False  # text has gone to the client: a refusal now ends only the speech
        self.finished = False  # the talker said `finished`
        self._settled = False  # the status is final (and counted in the metrics)
        self.call: grpc.aio.StreamStreamCall | None = None
        self.task: asyncio.Task | None = None
        self._chars = 0
        self._truncated = False
        self._text_over = False
        self._silence: asyncio.Timeout | None = None  # armed once the text is over and the talker is read
        self._reading = False  # the speech task waits for the talker (not for the client)
        self._stopped = False  # the gateway cancelled the call (stop): the status says why
        self._chunks = 0
        self._segment = 0

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
        self.requests.texts.put_nowait(text)
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
        """Stop speaking (the answer was aborted): cancel the call or the wait for a stream."""
        self.fail(code, message)
        self.requests.texts.put_nowait(_STOP)
        if self.call is not None and not self.call.done():
            self._stopped = True
            self.call.cancel()
        elif self.call is None and self.task is not None:
            self.task.cancel()

    def fail(self, code: str, message: str, retry_after_ms: int = 0) -> None:
        if not self.status.code:
            self.status.code, self.status.message, self.status.retry_after_ms = code, message, retry_after_ms

    # -- the speech task ---------------------------------------------------------------------------

    async def _speak(self) -> None:
        try:
            slot = await self._stream()
            if slot is not None:
                try:
                    self.call = self.talker.speak(self.requests, self.answer.remaining())
                except BaseException:
                    slot.release()
                    raise
                self.call.add_done_callback(lambda _call: slot.release())  # after the replica's credit
                await self._read(self.call)
        except asyncio.CancelledError:
            self.fail("CANCELLED", self.run.cancelled or "the answer was closed")
            raise
        finally:
            self.verdict.set()
            self.accepted.set()
            self.requests.texts.put_nowait(_STOP)  # grpc's task reading the requests ends too
            self._settle()

    async def _stream(self) -> Slot | None:
        """A talker stream for the speech: one of the `talker` gate's (the streams of the replicas that
        are up), at once or within `talker_stream_wait_s` (the text goes on meanwhile), on the least
        loaded replica with a credit. None, with the status set, when there is none."""
        replicas, gate, wait_s = self.stage.replicas, self.stage.gate, self.limits.stream_wait_s
        if not gate.has_room():
            self.accepted.set()  # the text does not wait for a stream
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_s
        while replicas.up():
            try:
                slot = await self.answer.ticket.join(self.stage.kind, max(0.0, until - loop.time()))
            except (Overloaded, DeadlineExceeded) as exc:
                wait_ms = getattr(exc, "retry_after_ms", 0) or int(gate.estimated_wait_s(coming=False) * 1000)
                self.fail(
                    "RESOURCE_EXHAUSTED",
                    f"{self.stage.kind}: all {gate.cfg.max_running} streams are speaking and none "
                    f"{'freed' if isinstance(exc, DeadlineExceeded) else 'is expected to free'} within "
                    f"{wait_s:g}s (gateway.talker_stream_wait_s)",
                    max(1, wait_ms),
                )
                return None
            talker = replicas.pick(_talker_load, TalkerClient.has_credit)
            if talker is not None:
                self.talker = talker
                return slot
            # The slot was given back by a call on a replica found down since: the gate has shrunk,
            # and the stream is waited for again (none when the gate still has room: every replica up
            # is full, its credits not counted by the gate).
            slot.release()
            if gate.has_room() and replicas.up():
                full = ", ".join(f"{t.name}: all {t.max_streams} streams are speaking" for t in replicas.up())
                self.fail("RESOURCE_EXHAUSTED", full, NO_CREDIT_RETRY_MS)
                return None
        self.fail("UNAVAILABLE", replicas.unavailable().args[0])  # the text goes on; the status says why
        return None

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            await self._read_speech(call)
        except grpc.aio.AioRpcError as exc:
            refusal = self._refused_or_failed(exc)
            if refusal is not None:
                self.run.fail(refusal)
        except TimeoutError:  # silence once the text was over (the read was cancelled: so is the call)
            self._stopped = True
            self.fail(
                "DEADLINE_EXCEEDED",
                f"{self.talker.name}: no speech for {self.limits.idle_timeout_s:g}s (gateway.talker_idle_timeout_s)",
            )
        except asyncio.CancelledError:
            if self.talker.lost_call():  # the talker went down under the call: the text goes on
                self.fail("UNAVAILABLE", self.talker.unavailable().args[0])
            elif asyncio.current_task().cancelling() or not self._stopped:
                raise  # the speech task was cancelled (the answer is closing), not only the call
        finally:
            self.verdict.set()
            self.accepted.set()
        if self._chunks:  # however it ended, the audio sent ends with a `last` chunk
            chunk = omni_pb2.AudioChunk(
                sample_rate_hz=self.status.sample_rate_hz, segment_index=self._segment, last=True
            )
            await self.run.emit(omni_pb2.GenerateEvent(request_id=self.run.request_id, audio=chunk))

    async def _read_speech(self, call: grpc.aio.StreamStreamCall) -> None:
        """The talker's events into the run; once the text is over, silence from the talker (not a slow
        client) past `talker_idle_timeout_s` ends the call (TimeoutError)."""
        try:
            async with asyncio.timeout(None) as self._silence:
                while True:
                    self._reading = True
                    self._arm_silence()
                    response = await call.read()
                    self._reading = False
                    self._silence.reschedule(None)
                    if response is grpc.aio.EOF:
                        self.fail("UNAVAILABLE", f"{self.talker.name}: the stream ended before it finished")
                        return
                    if await self._on_response(response):
                        await take_end(call)  # the last event: its own end (OK), not a cancel on close
                        return
        finally:
            self._reading, self._silence = False, None

    async def _on_response(self, response: talker_pb2.SpeakResponse) -> bool:
        """One event of the talker; True at its last (`finished`)."""
        kind = response.WhichOneof("event")
        if kind == "started":
            self.status.voice = response.started.voice
            self.status.sample_rate_hz = response.started.sample_rate_hz
            self.verdict.set()
            self.accepted.set()
        elif kind == "audio":
            a = response.audio
            self._chunks += 1
            self._segment = a.segment_index
            chunk = omni_pb2.AudioChunk(
                pcm16=a.pcm16, sample_rate_hz=self.status.sample_rate_hz, segment_index=a.segment_index
            )
            await self.run.emit(omni_pb2.GenerateEvent(request_id=self.run.request_id, audio=chunk))
        elif kind == "segment_done":
            self.status.segments += 1
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
            self.requests.texts.put_nowait(_END_OF_TEXT)
            self._arm_silence()

    def _arm_silence(self) -> None:
        """While the talker is read and the text is over: it has `talker_idle_timeout_s` to answer."""
        if self._text_over and self._reading and self._silence is not None and self._silence.when() is None:
            loop = asyncio.get_running_loop()
            self._silence.reschedule(loop.time() + self.limits.idle_timeout_s)

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
