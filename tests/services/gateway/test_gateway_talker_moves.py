"""A talker replica lost under a spoken answer (issue 43 point 6): the speech moves to a live replica
with room, from the first segment not spoken to its end (SegmentDone.text_end), ahead of answers whose
audio has not begun; else the Finish's AudioStatus names the replica lost and why the speech could not
go on. The other replica's streams are never touched; a new answer's call that finds its replica dead
goes to another one. Fake replicas: real TalkerClients whose Speak calls are scripted by each test, event
by event, so that the order of what happens is the test's (no timing)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from omnistage.common import metrics
from omnistage.common.runtime.errors import ERROR_REASON_KEY, NOTHING_TO_SPEAK
from omnistage.services.gateway.outputs.talker import SpeechLimits, SpeechStage
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.stages import TalkerClient
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import common_pb2, omni_pb2, talker_pb2

from tests.services.gateway.gateway_speech_fakes import Context, FakeThinker, wait_until

ANSWER = "One two three. Four five six. "
FIRST = len("One two three.")  # where the first segment ends in the answer's text
_CANCELLED = object()


class FakeCall:
    """A Speak call as grpc.aio hands it out: its requests read by a task of its own (as grpc's), its
    events and its end given by the test."""

    def __init__(self, requests) -> None:
        self.config: talker_pb2.SpeakConfig | None = None
        self.texts: list[str] = []
        self.end_of_text = False
        self.cancelled = False
        self._events: asyncio.Queue = asyncio.Queue()
        self._callbacks: list = []
        self._status: grpc.StatusCode | None = None
        self._ended = asyncio.Event()
        self._reader = asyncio.ensure_future(self._take(requests))

    async def _take(self, requests) -> None:
        async for message in requests:
            if message.HasField("config"):
                self.config = message.config
            if message.text:
                self.texts.append(message.text)
            self.end_of_text = self.end_of_text or message.end_of_text

    @property
    def text(self) -> str:
        return "".join(self.texts)

    # -- the test's side: the talker's events and the call's end ------------------------------------

    def started(self) -> None:
        started = talker_pb2.SpeakStarted(
            request_id=self.config.request_id, sample_rate_hz=44100, voice="DB30"
        )
        self._events.put_nowait(talker_pb2.SpeakResponse(started=started))

    def audio(self, segment: int) -> None:
        chunk = talker_pb2.SpeechChunk(pcm16=b"\x01\x00" * 10, segment_index=segment)
        self._events.put_nowait(talker_pb2.SpeakResponse(audio=chunk))

    def segment_done(self, segment: int, text_end: int) -> None:
        done = talker_pb2.SegmentDone(segment_index=segment, text_end=text_end)
        self._events.put_nowait(talker_pb2.SpeakResponse(segment_done=done))

    def finish(self) -> None:
        self._events.put_nowait(talker_pb2.SpeakResponse(finished=talker_pb2.SpeakFinished()))
        self._end(grpc.StatusCode.OK)

    def fail(self, code: grpc.StatusCode, details: str, reason: str = "") -> None:
        trailing = grpc.aio.Metadata(*([(ERROR_REASON_KEY, reason)] if reason else []))
        self._events.put_nowait(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details))
        self._end(code)

    # -- grpc.aio's side -----------------------------------------------------------------------------

    def done(self) -> bool:
        return self._status is not None

    def add_done_callback(self, callback) -> None:
        if self.done():
            callback(self)
        else:
            self._callbacks.append(callback)

    def cancel(self) -> bool:
        if self.done():
            return False
        self.cancelled = True
        self._events.put_nowait(_CANCELLED)
        self._end(grpc.StatusCode.CANCELLED)
        return True

    async def read(self):
        item = await self._events.get()
        if item is _CANCELLED:
            raise asyncio.CancelledError
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    async def code(self) -> grpc.StatusCode:
        await self._ended.wait()
        return self._status

    def _end(self, code: grpc.StatusCode) -> None:
        if self._status is None:
            self._status = code
            self._ended.set()
            self._reader.cancel()
            for callback in self._callbacks:
                callback(self)


class FakeReplica(TalkerClient):
    """A talker replica whose Speak calls are FakeCalls (its credits, tracking and loss the real ones)."""

    def __init__(self, name: str, streams: int) -> None:
        super().__init__(name, "127.0.0.1:1", 1 << 20)
        self.max_streams = streams
        self.calls: list[FakeCall] = []

    def speak(self, requests, timeout_s):
        call = FakeCall(requests)
        self.calls.append(call)
        return self.track(call)


class Gateway:
    """An OmniServicer over the fake thinker and fake talker replicas, each replica watched as the
    gateway's StageWatch does it: a call that finds it unreachable takes it out (`take_out`)."""

    def __init__(self, *replicas: FakeReplica, stream_wait_s: float = 30.0) -> None:
        self.replicas = replicas
        limits = SpeechLimits(start_wait_s=30.0, idle_timeout_s=30.0, stream_wait_s=stream_wait_s)
        self.speech = SpeechStage(list(replicas), limits, "gw-moves")
        self.pipeline = Pipeline(
            FakeThinker(ANSWER),
            {"thinker", "talker"},
            max_concurrent_requests=64,
            limits=RequestLimits(),
            system_prompt="",
            speech=self.speech,
        )
        self.servicer = OmniServicer(self.pipeline)
        for r in replicas:
            r.on_unreachable = lambda why, r=r: self.take_out(r, f"a call found it unreachable ({why})")

    def take_out(self, replica: FakeReplica, why: str) -> None:
        """What StageWatch._lose does: down, the gate shrinks, then its calls are cancelled."""
        replica.down_reason = f"stopped answering: {why}"
        self.pipeline.stages_changed()
        replica.lose_calls()

    def ask(self, request_id: str) -> asyncio.Task:
        msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Hi")])
        request = omni_pb2.GenerateRequest(
            request_id=request_id,
            messages=[msg],
            output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
            sampling=common_pb2.SamplingParams(max_tokens=16),
        )

        async def collect():
            return [e async for e in self.servicer.Generate(request, Context(60.0))]

        return asyncio.create_task(collect(), name=request_id)

    @property
    def gate(self):
        return self.pipeline.admission.gates["talker"]

    async def close(self) -> None:
        for r in self.replicas:
            await r.close()


@contextlib.asynccontextmanager
async def gateway(*replicas: FakeReplica, stream_wait_s: float = 30.0):
    gw = Gateway(*replicas, stream_wait_s=stream_wait_s)
    try:
        yield gw
    finally:
        await gw.close()


async def speaking(replica: FakeReplica, index: int, text: str = ANSWER) -> FakeCall:
    """The replica's call `index`, started, once it has `text` (all the answer's, by default)."""
    await wait_until(lambda: len(replica.calls) > index, what=f"call {index} on {replica.name}")
    call = replica.calls[index]
    await wait_until(lambda: call.config is not None, what="its config")
    call.started()
    await wait_until(lambda: call.text == text and call.end_of_text, what=f"{text!r} in {replica.name}")
    return call


def spoken(call: FakeCall, segments: int = 2) -> None:
    """The talker speaks the call's text to its end, in `segments` segments."""
    for i in range(segments):
        call.audio(i)
        call.segment_done(i, len(call.text) * (i + 1) // segments)
    call.finish()


def audio_of(events) -> list[omni_pb2.AudioChunk]:
    return [e.audio for e in events if e.HasField("audio")]


def moves(replica: str) -> float:
    sample = metrics.REGISTRY.get_sample_value(
        "omnistage_gateway_speech_moves_total", {"service": "gw-moves", "replica": replica}
    )
    return sample or 0.0


async def lost_after(gw: Gateway, replica: FakeReplica, text_end: int) -> asyncio.Task:
    """An answer on `replica`, lost (its connection reset) after one segment that ends at `text_end`."""
    answer = gw.ask("r1")
    call = await speaking(replica, 0)
    call.audio(0)
    call.segment_done(0, text_end)
    call.fail(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    return answer


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def kill(replica: FakeReplica, call: FakeCall, how: str, gw: Gateway) -> None:
    """The replica dies under `call`: its connection breaks (grpc's INTERNAL of a write into it), the
    talker says UNAVAILABLE, or its watch takes it out first (its calls cancelled)."""
    if how == "broken":
        call.fail(grpc.StatusCode.INTERNAL, "Internal error from Core")
    elif how == "unavailable":
        call.fail(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    else:
        gw.take_out(replica, "no health answer within 1s (3 checks in 1.5s)")


@pytest.mark.parametrize("how", ["broken", "unavailable", "watch"])
def test_a_lost_replicas_speech_goes_on_on_the_other_from_its_next_segment_ahead_of_new_answers(how):
    async def scenario():
        a, b = FakeReplica("talker", 1), FakeReplica("talker_b", 1)
        async with gateway(a, b) as gw:
            first = gw.ask("r1")  # on talker (equal loads take turns from the first)
            a1 = await speaking(a, 0)
            second = gw.ask("r2")  # on talker_b: talker has no credit left
            b1 = await speaking(b, 0)
            b1.audio(0)
            b1.segment_done(0, FIRST)
            b1.audio(1)  # the second segment is being spoken
            before = moves("talker_b")
            kill(b, b1, how, gw)
            await wait_until(lambda: gw.gate.waiting == 1, what="the moved speech waiting for a stream")
            third = gw.ask("r3")  # a new answer: waits behind the moved speech
            await wait_until(lambda: gw.gate.waiting == 2, what="the new answer waiting too")
            spoken(a1)  # talker's own answer, untouched, ends: its stream goes to the moved speech
            a2 = await speaking(a, 1, ANSWER[FIRST:])
            a2.audio(0)
            a2.segment_done(0, len(a2.text))
            a2.finish()
            spoken(await speaking(a, 2))
            events = await asyncio.gather(first, second, third)
            return events, [c.config.request_id for c in a.calls], a1.cancelled, moves("talker_b") - before

    (first, second, third), order, cancelled, moved = run(scenario())
    assert order == ["r1", "r2", "r3"]  # the moved speech took the freed stream before the new answer
    assert not cancelled  # talker's own speech was never touched
    for events in (first, second, third):
        assert events[-1].finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE, events[-1].finish.audio
    # r2: segment 0 on talker_b, segment 1 cut there, then spoken again on talker as segment 2
    chunks = audio_of(second)
    assert [(c.segment_index, c.last) for c in chunks] == [(0, False), (1, False), (2, False), (2, True)]
    assert second[-1].finish.audio.segments == 2 and second[-1].finish.audio.samples == 30
    assert moved == 1


def test_a_moved_speech_that_gets_no_stream_in_time_says_which_replica_was_lost_and_why():
    async def scenario():
        a, b = FakeReplica("talker", 1), FakeReplica("talker_b", 1)
        async with gateway(a, b, stream_wait_s=0.0) as gw:  # no wait: a stream free now or none
            first = gw.ask("r1")
            a1 = await speaking(a, 0)
            second = gw.ask("r2")
            b1 = await speaking(b, 0)
            b1.audio(0)
            b1.fail(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            events = await second
            spoken(a1)
            await first
            return events, len(a.calls), a1.cancelled

    events, calls, cancelled = run(scenario())
    audio = events[-1].finish.audio
    assert (audio.outcome, audio.code) == (omni_pb2.AUDIO_OUTCOME_PARTIAL, "RESOURCE_EXHAUSTED"), audio
    assert audio.message.startswith("talker_b: Socket closed; the speech could not go on: talker: all 1 ")
    assert "gateway.talker_stream_wait_s" in audio.message and audio.retry_after_ms > 0
    assert audio_of(events)[-1].last and not any(c.last for c in audio_of(events)[:-1])
    assert "".join(e.text.text for e in events if e.HasField("text")) == ANSWER  # the text is whole
    assert (calls, cancelled) == (1, False)  # talker kept its own stream


def test_a_moved_speech_with_no_other_replica_up_is_unavailable_naming_both():
    async def scenario():
        a, b = FakeReplica("talker", 1), FakeReplica("talker_b", 1)
        async with gateway(a, b) as gw:
            gw.take_out(a, "no health answer within 1s")
            second = gw.ask("r2")
            b1 = await speaking(b, 0)
            b1.audio(0)
            gw.take_out(b, "no health answer within 1s")
            return await second

    audio = run(scenario())[-1].finish.audio
    assert (audio.outcome, audio.code) == (omni_pb2.AUDIO_OUTCOME_PARTIAL, "UNAVAILABLE"), audio
    assert audio.message.startswith("stage 'talker_b' is unavailable: stopped answering")
    assert "the speech could not go on: no other talker replica is up ('talker': stopped answering" in (
        audio.message
    )


def test_a_new_answers_call_that_finds_its_replica_dead_is_spoken_by_another_whole():
    """Before its watch noticed: the dead replica has no call in flight, so it is the least loaded."""

    async def scenario():
        a, b = FakeReplica("talker", 2), FakeReplica("talker_b", 2)
        async with gateway(a, b) as gw:
            answer = gw.ask("r1")
            await wait_until(lambda: a.calls, what="a call on talker")
            a.calls[0].fail(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
            spoken(await speaking(b, 0))
            return await answer, a.up, len(a.calls)

    events, up, calls = run(scenario())
    audio = events[-1].finish.audio
    assert audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE and not audio.code, audio
    assert not up and calls == 1  # taken out at once: no second call there


def test_a_speech_lost_after_its_last_segment_is_complete_without_another_call():
    async def scenario():
        a, b = FakeReplica("talker", 1), FakeReplica("talker_b", 1)
        async with gateway(a, b) as gw:
            answer = await lost_after(gw, a, len(ANSWER))  # all of it, before its `finished`
            return await answer, len(b.calls)

    events, calls = run(scenario())
    audio = events[-1].finish.audio
    assert audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE and not audio.code, audio
    assert calls == 0 and audio_of(events)[-1].last


def test_a_moved_speech_whose_rest_has_nothing_to_speak_is_complete():
    async def scenario():
        a, b = FakeReplica("talker", 1), FakeReplica("talker_b", 1)
        async with gateway(a, b) as gw:
            answer = await lost_after(gw, a, len(ANSWER) - 1)
            b1 = await speaking(b, 0, " ")  # the trailing space: nothing a talker speaks
            b1.fail(grpc.StatusCode.INVALID_ARGUMENT, "text: nothing to speak", NOTHING_TO_SPEAK)
            return await answer

    audio = run(scenario())[-1].finish.audio
    assert audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE and not audio.code, audio
