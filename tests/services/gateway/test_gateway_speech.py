"""Omni.Generate with MODALITY_AUDIO against fake stages (the talker over real gRPC): text and audio
interleaved in one stream ending with one Finish after both; bounded buffers under a slow client;
a talker that is down, full, failing or silent never holds back the text and the Finish says why;
cancels and deadlines reach both stages; a refused voice is the client's INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from omnistage.common import metrics
from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable
from omnistage.services.gateway.outputs.talker import SpeechLimits
from omnistage.v1 import common_pb2, omni_pb2

from tests.services.gateway.gateway_speech_fakes import (
    Context,
    FakeTalker,
    FakeThinker,
    TalkerServer,
    close_quietly,
    gateway,
    wait_until,
)

ANSWER = "Hello there. How are you today? "


def request(voice: str = "", seed: int | None = 5, **kw) -> omni_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=16, **({"seed": seed} if seed is not None else {}))
    return omni_pb2.GenerateRequest(
        request_id="r1",
        voice=voice,
        sampling=sampling,
        output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Hi")])],
        **kw,
    )


async def collect(servicer, req, context=None) -> list[omni_pb2.GenerateEvent]:
    return [e async for e in servicer.Generate(req, context or Context())]


def kinds(events) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def text_of(events) -> str:
    return "".join(e.text.text for e in events if e.HasField("text"))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_text_and_audio_interleave_and_one_finish_comes_after_both():
    async def scenario():
        thinker, talker = FakeThinker(ANSWER, delay_s=0.02), FakeTalker()
        async with TalkerServer(talker) as srv:
            events = await collect(gateway(thinker, srv.address), request(voice="DB30"))
        return thinker, talker, events

    thinker, talker, events = run(scenario())
    k = kinds(events)
    assert k[-1] == "finish" and k.count("finish") == 1
    assert text_of(events) == ANSWER  # the whole text, as the thinker made it
    audio = [e.audio for e in events if e.HasField("audio")]
    assert k.index("audio") < len(k) - 1 - k[::-1].index(
        "text"
    )  # audio before the last text delta: interleaved
    assert [a.last for a in audio] == [False] * (len(audio) - 1) + [True] and audio[-1].pcm16 == b""
    assert {a.sample_rate_hz for a in audio} == {44100}
    assert {e.request_id for e in events} == {"r1"}
    (call,) = talker.calls
    assert (call.config.request_id, call.config.voice, call.config.seed) == ("r1", "DB30", 5)
    assert "".join(call.texts) == ANSWER and call.end_of_text and call.completed  # every delta, then the end
    status = events[-1].finish.audio
    assert status.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE and status.code == ""
    assert status.samples == sum(len(a.pcm16) for a in audio) // 2 > 0
    assert (status.voice, status.sample_rate_hz, status.segments) == (
        "DB30",
        44100,
        len(ANSWER.split(" ")) - 1,
    )
    assert 0 < status.time_to_first_audio_ms
    assert (
        events[-1].finish.reason == common_pb2.FINISH_REASON_STOP
        and events[-1].finish.usage.prompt_tokens == 7
    )
    assert thinker.calls[0].finished and thinker.calls[0].closed


def test_a_finished_speak_call_ends_with_its_own_status_not_a_cancel():
    """After `finished` the gateway lets the talker's handler return (its status OK) instead of cancelling
    the call at once (the real talker then counted every fourth completed stream as CANCELLED)."""

    async def scenario():
        talker = FakeTalker(end_delay_s=0.2)
        async with TalkerServer(talker) as srv:
            events = await collect(gateway(FakeThinker(ANSWER), srv.address), request())
        return talker, events

    talker, events = run(scenario())
    assert events[-1].finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE
    (call,) = talker.calls
    assert call.completed and not call.cancelled


def test_without_a_seed_the_talker_picks_one_and_an_empty_voice_is_its_default():
    async def scenario():
        talker = FakeTalker()
        async with TalkerServer(talker) as srv:
            events = await collect(gateway(FakeThinker(), srv.address), request(seed=None))
        return talker, events

    talker, events = run(scenario())
    assert not talker.calls[0].config.HasField("seed") and talker.calls[0].config.voice == ""
    assert events[-1].finish.audio.voice == "DB30"


def test_a_slow_client_fills_only_its_own_bounded_buffer():
    """The client stops reading: the gateway holds `buffer_events` events and the talker is paused by flow
    control (it produced a fraction of the 400 chunks of 64 KiB); a second request meanwhile completes."""
    buffer = 4

    async def scenario():
        talker = FakeTalker(chunks_per_text=400, chunk_samples=32768)
        async with TalkerServer(talker) as srv:
            servicer = gateway(
                FakeThinker("Hello. "),
                srv.address,
                limits=SpeechLimits(start_wait_s=5.0, idle_timeout_s=30.0, buffer_events=buffer),
            )
            slow = servicer.Generate(request(), Context())
            first = [
                await anext(slow) for _ in range(3)
            ]  # the text and the first chunk: then the client stalls
            await wait_until(
                lambda: talker.calls and talker.calls[0].produced > buffer, what="talker producing"
            )
            await asyncio.sleep(1.0)  # time enough to read all 400 chunks if nothing held the talker back
            stalled_at = talker.calls[0].produced
            other = gateway(FakeThinker("Fine. "), srv.address)
            fast_talker_calls = len(talker.calls)
            talker.chunks_per_text = 2
            other_events = await collect(other, request())
            rest = [e async for e in slow]
        return first, stalled_at, fast_talker_calls, other_events, first + rest

    first, stalled_at, _, other_events, events = run(scenario())
    assert stalled_at < 200, f"the talker ran ahead of a stalled client: {stalled_at} chunks of 64 KiB"
    assert (
        other_events[-1].finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE
    )  # not held by the slow one
    audio = [e for e in events if e.HasField("audio") and e.audio.pcm16]
    assert len(audio) == 400 and events[-1].finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE


def test_a_talker_that_is_down_leaves_the_text_whole():
    async def scenario():
        with socket.socket() as s:  # a port nobody listens on: connections are refused
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        return await collect(gateway(FakeThinker(ANSWER), address), request())

    events = run(scenario())
    assert text_of(events) == ANSWER and kinds(events).count("audio") == 0
    status = events[-1].finish.audio
    assert (status.outcome, status.code) == (omni_pb2.AUDIO_OUTCOME_NONE, "UNAVAILABLE")
    assert status.message.startswith("talker: ")


def test_a_talker_lost_mid_speech_ends_only_the_speech_naming_it_and_a_down_talker_is_not_called():
    """What the gateway's StageWatch does when the talker stops answering: its calls are cancelled
    (the text goes on, the status says the talker is down), and while it is down no call is made."""

    async def scenario():
        talker = FakeTalker("silent")
        async with TalkerServer(talker) as srv:
            servicer = gateway(FakeThinker(ANSWER, delay_s=0.02), srv.address)
            client = servicer.pipeline.speech.talker
            answer = asyncio.create_task(collect(servicer, request()))
            await wait_until(
                lambda: talker.calls and talker.calls[0].texts, what="the first text in the talker"
            )
            client.down_reason = "stopped answering: no health answer within 2s"  # the watch's verdict ...
            assert client.lose_calls() == 1  # ... and its action
            first = await answer
            second = await collect(servicer, request())
        return first, second, len(talker.calls)

    first, second, calls = run(scenario())
    for events in (first, second):
        assert text_of(events) == ANSWER
        status = events[-1].finish.audio
        assert status.code == "UNAVAILABLE" and status.outcome == omni_pb2.AUDIO_OUTCOME_NONE, status
        assert (
            status.message == "stage 'talker' is unavailable: stopped answering: no health answer within 2s"
        )
    assert calls == 1  # the down talker got no second call


def test_a_full_talker_gives_no_audio_with_its_pushback():
    async def scenario():
        async with TalkerServer(FakeTalker("busy")) as srv:
            return await collect(gateway(FakeThinker(ANSWER), srv.address), request())

    events = run(scenario())
    assert text_of(events) == ANSWER
    status = events[-1].finish.audio
    assert (status.outcome, status.code, status.retry_after_ms) == (
        omni_pb2.AUDIO_OUTCOME_NONE,
        "RESOURCE_EXHAUSTED",
        500,
    )


def test_a_spoken_answers_text_never_waits_for_a_talker_stream_and_its_audio_joins_when_one_frees():
    """With the talker's cap (Describe) of 1 held by one answer, the next one's text streams at once (its
    thinker call made while the first still speaks) and its audio waits for the stream in the gateway;
    once the first is over it is spoken, the talker getting the text so far (issue 38)."""

    async def scenario():
        thinker, talker = FakeThinker(ANSWER, delay_s=0.05), FakeTalker()
        async with TalkerServer(talker) as srv:
            servicer = gateway(thinker, srv.address, max_streams=1)
            gate = servicer.pipeline.admission.gates["talker"]
            first = servicer.Generate(request(), Context())
            await anext(first)
            await wait_until(lambda: len(talker.calls) == 1, what="the first Speak")
            second_events: list = []

            async def second_client():
                async for event in servicer.Generate(request(), Context()):
                    second_events.append(event)

            second = asyncio.create_task(second_client())
            await wait_until(lambda: gate.waiting == 1, what="the second answer's audio waiting")
            await wait_until(lambda: second_events, what="the second answer's first text")
            calls_then = (len(thinker.calls), len(talker.calls), kinds(second_events))
            rest = [e async for e in first]
            await second
        return calls_then, rest, second_events, talker, gate

    calls_then, rest, second, talker, gate = run(scenario())
    assert calls_then[:2] == (2, 1) and set(calls_then[2]) == {"text"}  # text out, no Speak call yet
    for events in (rest, second):
        assert events[-1].finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE
    assert text_of(second) == ANSWER and "".join(talker.calls[1].texts) == ANSWER
    assert talker.most_active == 1 and (gate.running, gate.waiting) == (0, 0)


def test_concurrent_spoken_answers_share_the_talkers_streams_and_all_speak():
    async def scenario():
        talker = FakeTalker()
        async with TalkerServer(talker) as srv:
            servicer = gateway(FakeThinker(ANSWER, delay_s=0.01), srv.address, max_streams=2)
            answers = await asyncio.gather(*(collect(servicer, request()) for _ in range(5)))
        return answers, talker.most_active, servicer.pipeline.admission.gates["talker"].running

    answers, most_active, running = run(scenario())
    assert [a[-1].finish.audio.outcome for a in answers] == [omni_pb2.AUDIO_OUTCOME_COMPLETE] * 5
    assert most_active == 2 and running == 0


def test_audio_that_gets_no_talker_stream_within_the_wait_is_a_status_never_a_failed_request():
    """The stream stays held past gateway.talker_stream_wait_s: the second answer is text only, whole,
    and its AudioStatus says RESOURCE_EXHAUSTED with a retry hint; nothing waits afterwards."""

    async def scenario():
        talker = FakeTalker(speak_delay_s=0.05)
        limits = SpeechLimits(start_wait_s=5.0, idle_timeout_s=5.0, stream_wait_s=0.2)
        async with TalkerServer(talker) as srv:
            servicer = gateway(
                FakeThinker(ANSWER * 4, delay_s=0.05), srv.address, max_streams=1, limits=limits
            )
            first = servicer.Generate(request(), Context())
            await anext(first)
            second = await collect(servicer, request())
            rest = [e async for e in first]
        return second, rest, len(talker.calls), servicer.pipeline.admission.gates["talker"]

    second, rest, calls, gate = run(scenario())
    assert text_of(second) == ANSWER * 4 and kinds(second).count("audio") == 0
    status = second[-1].finish.audio
    assert (status.outcome, status.code) == (omni_pb2.AUDIO_OUTCOME_NONE, "RESOURCE_EXHAUSTED")
    assert status.retry_after_ms > 0 and "talker" in status.message
    assert rest[-1].finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE and calls == 1
    assert (gate.running, gate.waiting) == (0, 0)


def test_a_talker_failing_mid_speech_gives_partial_audio_and_the_whole_text():
    async def scenario():
        async with TalkerServer(FakeTalker("fail-after-audio")) as srv:
            return await collect(gateway(FakeThinker(ANSWER, delay_s=0.01), srv.address), request())

    events = run(scenario())
    assert text_of(events) == ANSWER
    audio = [e.audio for e in events if e.HasField("audio")]
    assert audio[-1].last and audio[0].pcm16
    status = events[-1].finish.audio
    assert (status.outcome, status.code) == (omni_pb2.AUDIO_OUTCOME_PARTIAL, "UNAVAILABLE")
    assert "died while serving" in status.message


def test_a_stream_broken_under_a_write_is_the_talker_unavailable_not_an_internal_error():
    """A talker killed mid-speech: a write racing the broken connection makes grpc say INTERNAL
    "Internal error from Core" before the watch has marked the talker down."""

    async def scenario():
        async with TalkerServer(FakeTalker("broken-after-audio")) as srv:
            return await collect(gateway(FakeThinker(ANSWER, delay_s=0.01), srv.address), request())

    events = run(scenario())
    assert text_of(events) == ANSWER
    status = events[-1].finish.audio
    assert (status.outcome, status.code) == (omni_pb2.AUDIO_OUTCOME_PARTIAL, "UNAVAILABLE")
    assert status.message == "talker: the stream broke (Internal error from Core)"


def test_a_talker_that_takes_no_connection_is_given_up_after_the_idle_timeout():
    """A listening socket that never accepts: the call never connects (gRPC would try for 20 s)."""

    async def scenario():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen(0)
            servicer = gateway(
                FakeThinker(ANSWER),
                f"127.0.0.1:{s.getsockname()[1]}",
                limits=SpeechLimits(start_wait_s=0.2, idle_timeout_s=0.3),
            )
            return await collect(servicer, request())

    events = run(scenario())
    assert text_of(events) == ANSWER
    assert (events[-1].finish.audio.outcome, events[-1].finish.audio.code) == (
        omni_pb2.AUDIO_OUTCOME_NONE,
        "DEADLINE_EXCEEDED",
    )


def test_a_silent_talker_is_given_up_after_the_idle_timeout():
    async def scenario():
        talker = FakeTalker("silent")
        async with TalkerServer(talker) as srv:
            servicer = gateway(
                FakeThinker(ANSWER), srv.address, limits=SpeechLimits(start_wait_s=5.0, idle_timeout_s=0.3)
            )
            events = await collect(servicer, request())
            await wait_until(lambda: talker.calls[0].cancelled, what="the Speak call cancelled")
        return events

    events = run(scenario())
    assert text_of(events) == ANSWER
    status = events[-1].finish.audio
    assert (status.outcome, status.code) == (omni_pb2.AUDIO_OUTCOME_NONE, "DEADLINE_EXCEEDED")
    assert "talker_idle_timeout_s" in status.message


def test_an_answer_with_nothing_to_speak_is_said_in_the_status():
    async def scenario():
        async with TalkerServer(FakeTalker("nothing")) as srv:
            return await collect(gateway(FakeThinker("... !! "), srv.address), request())

    events = run(scenario())
    status = events[-1].finish.audio
    assert (status.outcome, status.code) == (
        omni_pb2.AUDIO_OUTCOME_PARTIAL,
        "INVALID_ARGUMENT",
    )  # the echo spoke "..."
    assert "nothing to speak" in status.message and events[-1].finish.reason == common_pb2.FINISH_REASON_STOP


def test_text_past_the_talkers_limit_is_spoken_up_to_it():
    async def scenario():
        talker = FakeTalker()
        async with TalkerServer(talker) as srv:
            servicer = gateway(
                FakeThinker(ANSWER), srv.address, limits=SpeechLimits(max_text_chars=20, start_wait_s=5.0)
            )
            events = await collect(servicer, request())
        return talker, events

    talker, events = run(scenario())
    assert "".join(talker.calls[0].texts) == ANSWER[:20] and talker.calls[0].end_of_text
    assert text_of(events) == ANSWER
    status = events[-1].finish.audio
    assert (status.outcome, status.code) == (omni_pb2.AUDIO_OUTCOME_PARTIAL, "OUT_OF_RANGE")


def test_an_unknown_voice_is_the_clients_error_named_as_its_field():
    async def scenario():
        thinker = FakeThinker(ANSWER, delay_s=0.05)
        async with TalkerServer(FakeTalker("refuse-voice")) as srv:
            servicer = gateway(thinker, srv.address)
            received = []
            with pytest.raises(InvalidRequest) as err:
                async for event in servicer.Generate(request(voice="nobody"), Context()):
                    received.append(event)
        return thinker, received, err.value

    thinker, received, err = run(scenario())
    assert str(err).startswith("voice: unknown voice 'nobody'")
    assert received == []  # no text went out before the verdict
    assert thinker.calls[0].closed and not thinker.calls[0].finished


def test_a_voice_refused_while_the_text_waits_for_it_ends_the_request_however_long_the_answer():
    """The refusal wakes the text pump's wait for the voice just as the failing answer cancels the pump:
    that cancellation must stop it (Python 3.11's asyncio.wait_for returned instead and lost it; the
    pump then filled the client buffer nobody read, and the request hung with both stages idle)."""

    async def scenario():
        words = " ".join(f"w{i}" for i in range(64))  # 4x the client buffer (16 events)
        thinker = FakeThinker(words)  # every delta at once: the first waits for the talker's verdict
        async with TalkerServer(FakeTalker("refuse-voice", refuse_delay_s=0.3)) as srv:
            servicer = gateway(thinker, srv.address)
            with pytest.raises(InvalidRequest) as err:
                await asyncio.wait_for(collect(servicer, request(voice="nobody")), 10)
            await wait_until(lambda: thinker.calls[0].closed, what="the thinker stream closed")
            assert servicer.pipeline.in_flight == 0
        return thinker, err.value

    thinker, err = run(scenario())
    assert str(err).startswith("voice: unknown voice 'nobody'")
    assert not thinker.calls[0].finished


def test_bad_speech_fields_are_refused_before_any_stage():
    clip = omni_pb2.VoiceClip(audio=b"RIFF", transcript="hi")
    cases = [
        (request(voice="DB30", custom_voice=clip), "custom_voice: set voice or custom_voice, not both"),
        (request(custom_voice=omni_pb2.VoiceClip(transcript="hi")), "custom_voice.audio: required"),
        (request(custom_voice=omni_pb2.VoiceClip(audio=b"RIFF")), "custom_voice.transcript: required"),
        (request(voice="x" * 300), "voice: a preset voice name"),
    ]
    for req, needle in cases:
        thinker = FakeThinker()

        async def scenario(req=req, thinker=thinker):
            return await collect(gateway(thinker, "127.0.0.1:1"), req)

        with pytest.raises(InvalidRequest) as err:
            run(scenario())
        assert str(err.value).startswith(needle) and thinker.calls == []


def test_a_custom_voice_goes_to_the_talker():
    async def scenario():
        talker = FakeTalker()
        async with TalkerServer(talker) as srv:
            clip = omni_pb2.VoiceClip(audio=b"RIFF....WAVE", transcript="A clip.")
            events = await collect(gateway(FakeThinker(), srv.address), request(custom_voice=clip))
        return talker, events

    talker, events = run(scenario())
    custom = talker.calls[0].config.custom_voice
    assert (custom.audio, custom.transcript) == (b"RIFF....WAVE", "A clip.")
    assert events[-1].finish.audio.voice == "custom"


def test_audio_without_a_talker_is_failed_precondition_naming_it():
    async def scenario():
        return await collect(gateway(FakeThinker(), None), request())

    with pytest.raises(StageUnavailable) as err:
        run(scenario())
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "'talker'" in str(err.value)


def test_a_client_cancel_mid_speech_reaches_both_stages():
    async def scenario():
        thinker, talker = FakeThinker(ANSWER * 20, delay_s=0.02), FakeTalker()
        async with TalkerServer(talker) as srv:
            stream = gateway(thinker, srv.address).Generate(request(), Context())
            async for event in stream:
                if event.HasField("audio"):
                    break
            await close_quietly(stream)  # what grpc does to the handler when the client cancels
            await wait_until(lambda: talker.calls[0].cancelled, what="the Speak call cancelled")
        return thinker, talker

    thinker, talker = run(scenario())
    assert thinker.calls[0].closed and not thinker.calls[0].finished
    assert not talker.calls[0].completed


def test_the_deadline_reaches_both_stages():
    async def scenario():
        thinker, talker = FakeThinker(), FakeTalker()
        async with TalkerServer(talker) as srv:
            await collect(gateway(thinker, srv.address), request(), Context(remaining_s=12.0))
        return thinker, talker

    thinker, talker = run(scenario())
    assert thinker.calls[0].timeout_s == 12.0
    assert 10.0 < talker.calls[0].deadline_s <= 12.5  # (gRPC rounds deadlines up a little)


def test_an_aborted_answer_is_not_spoken_to_its_end():
    async def scenario():
        talker = FakeTalker()
        async with TalkerServer(talker) as srv:
            events = await collect(
                gateway(FakeThinker(ANSWER, reason=common_pb2.FINISH_REASON_ABORT), srv.address), request()
            )
            await wait_until(lambda: talker.calls[0].cancelled, what="the Speak call cancelled")
        return events

    events = run(scenario())
    assert events[-1].finish.reason == common_pb2.FINISH_REASON_ABORT
    assert (
        events[-1].finish.audio.code == "CANCELLED"
        and "FINISH_REASON_ABORT" in events[-1].finish.audio.message
    )


def test_time_to_first_audio_is_exported_by_voice():
    def count() -> float:
        return (
            metrics.REGISTRY.get_sample_value(
                "omnistage_gateway_ttfa_seconds_count", {"service": "gw-test", "voice": "DB30"}
            )
            or 0.0
        )

    before = count()

    async def scenario():
        async with TalkerServer(FakeTalker()) as srv:
            await collect(gateway(FakeThinker(), srv.address), request(voice="DB30"))

    run(scenario())
    assert count() == before + 1


@pytest.mark.parametrize(
    ("mode", "good"), [("echo", 1), ("busy", 0), ("nothing", 0), ("fail-after-audio", 0)]
)
def test_a_spoken_answer_is_good_only_with_its_audio_complete(mode, good):
    """Goodput has the definition `omnistage bench` uses (common/answer_outcome.py): the text alone does
    not make a spoken request good."""

    def goodput() -> float:
        return (
            metrics.REGISTRY.get_sample_value(
                "omnistage_gateway_goodput_requests_total", {"service": "gateway", "modality": "audio+text"}
            )
            or 0.0
        )

    before = goodput()

    async def scenario():
        async with TalkerServer(FakeTalker(mode)) as srv:
            return await collect(gateway(FakeThinker(ANSWER), srv.address), request())

    events = run(scenario())
    assert text_of(events) == ANSWER and events[-1].finish.reason == common_pb2.FINISH_REASON_STOP
    assert (events[-1].finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE) == bool(good)
    assert goodput() == before + good
