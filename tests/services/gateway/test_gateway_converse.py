"""Omni.Converse against fake stages (the talker over real gRPC): turns answered with text and speech from
the call's history, one Finish per turn; barge-in cancels the answer's thinker and talker streams and
says so; spoken turns reach the encoder as the client's PCM; bad input ends the call naming the field."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from omnistage.common.metrics import REGISTRY
from omnistage.common.runtime.errors import InvalidRequest, OmniError, StageUnavailable
from omnistage.services.gateway.converse import ConverseLimits, _Answer
from omnistage.services.gateway.encode_cache import EncodeCache
from omnistage.services.gateway.history import Entry
from omnistage.services.gateway.stages import StageError
from omnistage.v1 import common_pb2, omni_pb2

from tests.services.gateway.gateway_speech_fakes import (
    PROMPT_TOKENS,
    Context,
    FakeMedia,
    FakeTalker,
    FakeThinker,
    TalkerServer,
    gateway,
    wait_until,
)

ANSWER = "Hello there. How are you today? "


def config(**kw) -> omni_pb2.ConverseRequest:
    kw.setdefault("request_id", "c1")
    kw.setdefault("sampling", common_pb2.SamplingParams(max_tokens=16, seed=3))
    return omni_pb2.ConverseRequest(config=omni_pb2.GenerateRequest(**kw))


def text(t: str) -> omni_pb2.ConverseRequest:
    return omni_pb2.ConverseRequest(text=t)


def audio(pcm: bytes, rate: int = 16000) -> omni_pb2.ConverseRequest:
    return omni_pb2.ConverseRequest(audio=omni_pb2.AudioChunk(pcm16=pcm, sample_rate_hz=rate))


END_OF_TURN = omni_pb2.ConverseRequest(end_of_turn=True)


class Client:
    """The client's side of the stream: messages sent when the test says, half-close at `close()`."""

    def __init__(self, *first: omni_pb2.ConverseRequest) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        for message in first:
            self.send(message)

    def send(self, message: omni_pb2.ConverseRequest) -> None:
        self.queue.put_nowait(message)

    def close(self) -> None:
        self.queue.put_nowait(None)

    async def requests(self):
        while (message := await self.queue.get()) is not None:
            yield message


def finishes(events) -> list[omni_pb2.GenerateEvent]:
    return [e for e in events if e.HasField("finish")]


def turn_text(events, turn: int) -> str:
    return "".join(e.text.text for e in events if e.HasField("text") and e.turn == turn)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def converse(servicer, client: Client, on_event=None) -> list[omni_pb2.GenerateEvent]:
    events = []
    async for event in servicer.Converse(client.requests(), Context()):
        events.append(event)
        if on_event is not None:
            on_event(event, events)
    return events


def test_two_text_turns_are_answered_from_the_history():
    async def scenario():
        thinker, talker = FakeThinker(ANSWER), FakeTalker()
        async with TalkerServer(talker) as srv:
            servicer = gateway(thinker, srv.address)
            client = Client(config(voice="DB30", system_prompt="Be brief."), text("First question?"))

            def on_event(event, events):
                if event.HasField("finish") and event.turn == 0:
                    client.send(text("Second question?"))
                    client.close()

            events = await converse(servicer, client, on_event)
            in_flight = servicer.pipeline.in_flight
        return thinker, talker, events, in_flight

    thinker, talker, events, in_flight = run(scenario())
    done = finishes(events)
    assert [(f.turn, f.finish.reason) for f in done] == [
        (0, common_pb2.FINISH_REASON_STOP),
        (1, common_pb2.FINISH_REASON_STOP),
    ]
    assert events[-1] is done[-1] and {e.request_id for e in events} == {"c1"}
    assert [f.finish.audio.outcome for f in done] == [omni_pb2.AUDIO_OUTCOME_COMPLETE] * 2
    assert turn_text(events, 0) == turn_text(events, 1) == ANSWER
    for turn in (0, 1):  # each turn: its audio, ending with the `last` chunk, before its Finish
        chunks = [e.audio for e in events if e.HasField("audio") and e.turn == turn]
        assert chunks[0].pcm16 and chunks[-1].last
    first, second = (c.prompt for c in thinker.calls)
    assert first.startswith("<role>SYSTEM</role>Be brief.") and first.endswith(
        "<role>HUMAN</role>First question?<|role_end|><role>ASSISTANT</role>"
    )
    # The answer goes back as the ids the thinker generated, its stop token left out (prefix caching).
    assert second.endswith(
        "<role>HUMAN</role>First question?<|role_end|><role>ASSISTANT</role><tokens:0,1,2,3,4,5>"
        "<|role_end|><role>HUMAN</role>Second question?<|role_end|><role>ASSISTANT</role>"
    )
    assert [c.config.voice for c in talker.calls] == ["DB30", "DB30"] and talker.calls[0].config.seed == 3
    assert in_flight == 0


def test_a_new_turn_interrupts_the_answer_and_both_stages_stop():
    async def scenario():
        thinker, talker = FakeThinker(ANSWER * 20, delay_s=0.03), FakeTalker()
        async with TalkerServer(talker) as srv:
            client = Client(config(), text("Tell me a long story."))

            def on_event(event, events):
                if (
                    event.HasField("audio")
                    and event.turn == 0
                    and sum(e.HasField("audio") for e in events) == 2
                ):
                    thinker.answer, thinker.delay_s = "Sure. ", 0.0
                    client.send(text("Stop, please."))
                if event.HasField("finish") and event.turn == 1:
                    client.close()

            events = await converse(gateway(thinker, srv.address), client, on_event)
            await wait_until(lambda: talker.calls[0].cancelled, what="turn 0's Speak call cancelled")
        return thinker, talker, events

    thinker, talker, events = run(scenario())
    first, second = finishes(events)
    assert (first.turn, first.finish.reason) == (0, common_pb2.FINISH_REASON_INTERRUPTED)
    assert first.finish.message == "interrupted by user turn 1"
    status = first.finish.audio
    assert (status.outcome, status.code) == (
        omni_pb2.AUDIO_OUTCOME_PARTIAL,
        "CANCELLED",
    ) and status.samples > 0
    assert (second.turn, second.finish.reason) == (1, common_pb2.FINISH_REASON_STOP)
    assert (
        max(i for i, e in enumerate(events) if e.turn == 0) < events.index(second) - 1
    )  # turn 0 ended before 1
    assert thinker.calls[0].closed and not thinker.calls[0].finished  # the thinker request was aborted
    assert not talker.calls[0].completed and talker.calls[1].completed
    partial = turn_text(events, 0)
    assert partial and len(partial) < len(ANSWER * 20)
    assert first.finish.usage.completion_tokens == sum(
        len(e.text.token_ids) for e in events if e.HasField("text") and e.turn == 0
    )
    # Its prompt as the thinker counted it (its `started`): the answer never got the thinker's finish.
    assert first.finish.usage.prompt_tokens == PROMPT_TOKENS
    # The history keeps the interrupted answer as far as the client got it.
    assert thinker.calls[1].prompt.endswith(
        f"<role>ASSISTANT</role>{partial}<|role_end|><role>HUMAN</role>Stop, please.<|role_end|><role>ASSISTANT</role>"
    )


def test_a_cancel_message_stops_the_answer_and_the_next_turn_is_answered():
    async def scenario():
        thinker, talker = FakeThinker(ANSWER * 20, delay_s=0.03), FakeTalker()
        async with TalkerServer(talker) as srv:
            client = Client(config(), text("Tell me a long story."))

            def on_event(event, events):
                if (
                    event.HasField("audio")
                    and event.turn == 0
                    and sum(e.HasField("audio") for e in events) == 2
                ):
                    client.send(omni_pb2.ConverseRequest(cancel=True))
                if event.HasField("finish") and event.turn == 0:
                    thinker.answer, thinker.delay_s = "Sure. ", 0.0
                    client.send(omni_pb2.ConverseRequest(cancel=True))  # none runs: nothing happens
                    client.send(text("Short, then."))
                if event.HasField("finish") and event.turn == 1:
                    client.close()

            events = await converse(gateway(thinker, srv.address), client, on_event)
            await wait_until(lambda: talker.calls[0].cancelled, what="turn 0's Speak call cancelled")
        return thinker, events

    thinker, events = run(scenario())
    first, second = finishes(events)
    assert (first.turn, first.finish.reason) == (0, common_pb2.FINISH_REASON_INTERRUPTED)
    assert first.finish.message == "cancelled by the client" and first.finish.audio.code == "CANCELLED"
    assert thinker.calls[0].closed and not thinker.calls[0].finished
    assert (second.turn, second.finish.reason) == (1, common_pb2.FINISH_REASON_STOP)
    assert turn_text(events, 1) == "Sure. "


def test_turns_sent_back_to_back_each_get_one_finish():
    async def scenario():
        thinker = FakeThinker(ANSWER, delay_s=0.01)
        async with TalkerServer(FakeTalker()) as srv:
            client = Client(config(), text("One?"), text("Two?"), text("Three?"))
            client.close()
            events = await converse(gateway(thinker, srv.address), client)
        return thinker, events

    thinker, events = run(scenario())
    done = finishes(events)
    assert [f.turn for f in done] == [0, 1, 2]
    assert [f.finish.reason for f in done[:2]] == [common_pb2.FINISH_REASON_INTERRUPTED] * 2
    assert done[2].finish.reason == common_pb2.FINISH_REASON_STOP and turn_text(events, 2) == ANSWER
    assert all(c.closed for c in thinker.calls) and thinker.calls[-1].finished
    assert thinker.calls[-1].prompt.count("<role>HUMAN</role>") == 3  # superseded turns stay in the history


def _pcm(seconds: float, rate: int = 16000) -> bytes:
    return b"\x10\x00" * int(seconds * rate)


def test_spoken_turns_reach_the_encoder_as_pcm_and_stay_in_the_history():
    """The turn's PCM16 goes to the encoder as it came (samples at its rate: no WAV written here to be
    decoded there), and stays in the history for the next answers."""

    async def scenario():
        thinker, media = FakeThinker(ANSWER), FakeMedia()
        async with TalkerServer(FakeTalker()) as srv:
            servicer = gateway(thinker, srv.address, media=media)
            client = Client(config(), audio(_pcm(0.25)), audio(_pcm(0.25)), END_OF_TURN)

            def on_event(event, events):
                if event.HasField("finish") and event.turn == 0:
                    client.send(audio(_pcm(0.5, 8000), 8000))
                    client.close()  # half-closed mid-turn: the turn is taken as ended

            events = await converse(servicer, client, on_event)
        return thinker, media, events

    thinker, media, events = run(scenario())
    assert [f.finish.reason for f in finishes(events)] == [common_pb2.FINISH_REASON_STOP] * 2
    first, second = media.requests
    assert [p.kind for p in first] == ["audio"] and [p.where for p in second] == [
        "audio (turn 0)",
        "audio (turn 1)",
    ]
    assert (first[0].media.data, first[0].pcm_rate_hz) == (_pcm(0.5), 16000)
    assert (second[1].media.data, second[1].pcm_rate_hz) == (_pcm(0.5, 8000), 8000)
    audio_markup = "<audio>" + "<audioPatch>" * 3 + "</audio>"
    assert thinker.calls[1].prompt.count(audio_markup) == 2 and len(thinker.calls[1].multimodal) == 2
    assert media.released == []  # the thinker took every ref


def test_with_the_encode_cache_each_clip_is_encoded_once_per_call_and_released_when_it_ends():
    """Each turn's Encode carries only its new clip: the earlier ones are lent from the cache to the
    thinker, which copies the rows and leaves the leases (caller_keeps_lease); the call's end releases
    them all. Each turn's media, first text and first audio are timed from its end
    (gateway_turn_seconds), the call's first turn apart from the later one."""
    phases = [(p, t) for p in ("media", "first_text", "first_audio") for t in ("first", "later")]

    def turns_timed(phase: str, turn: str) -> float:
        labels = {"service": "gateway", "phase": phase, "turn": turn}
        return REGISTRY.get_sample_value("omnistage_gateway_turn_seconds_count", labels) or 0.0

    async def scenario():
        thinker, media = FakeThinker(ANSWER), FakeMedia()
        cache = EncodeCache(media, 8, 1 << 20, service="t-converse")
        async with TalkerServer(FakeTalker()) as srv:
            servicer = gateway(thinker, srv.address, media=media, kept=cache)
            client = Client(config(), audio(_pcm(0.25)), END_OF_TURN)

            def on_event(event, events):
                if event.HasField("finish") and event.turn == 0:
                    client.send(audio(_pcm(0.5, 8000), 8000))
                    client.send(END_OF_TURN)
                    client.close()

            events = await converse(servicer, client, on_event)
        return thinker, media, events, cache.held

    before = {(p, t): turns_timed(p, t) for p, t in phases}
    thinker, media, events, held = run(scenario())
    assert [f.finish.reason for f in finishes(events)] == [common_pb2.FINISH_REASON_STOP] * 2
    assert [[p.where for p in r] for r in media.requests] == [["audio (turn 0)"], ["audio (turn 1)"]]
    assert [len(c.multimodal) for c in thinker.calls] == [1, 2]
    assert all(m.caller_keeps_lease for c in thinker.calls for m in c.multimodal)
    assert len(media.released) == 2 and held == 0  # the call ended: both clips' leases released
    assert {k: turns_timed(*k) - n for k, n in before.items()} == dict.fromkeys(phases, 1)


def test_the_first_audio_chunk_of_a_turn_interrupts_the_answer():
    async def scenario():
        thinker = FakeThinker(ANSWER * 20, delay_s=0.03)
        async with TalkerServer(FakeTalker()) as srv:
            client = Client(config(), text("Go on."))
            interrupted_before_end_of_turn = []

            def on_event(event, events):
                if event.HasField("text") and event.turn == 0 and turn_text(events, 0).count(" ") == 3:
                    thinker.answer, thinker.delay_s = "Yes. ", 0.0
                    client.send(audio(_pcm(0.1)))
                if event.HasField("finish") and event.turn == 0:
                    interrupted_before_end_of_turn.append(event.finish.reason)
                    client.send(END_OF_TURN)
                    client.close()

            events = await converse(gateway(thinker, srv.address, media=FakeMedia()), client, on_event)
        return events, interrupted_before_end_of_turn

    events, seen = run(scenario())
    assert seen == [common_pb2.FINISH_REASON_INTERRUPTED]
    assert [f.finish.reason for f in finishes(events)][1] == common_pb2.FINISH_REASON_STOP


def test_a_malformed_message_during_a_spoken_answer_ends_the_call_at_once():
    """Each incoming message is checked when it arrives (issue 30, point 5): a bad audio chunk while the
    answer before it speaks ends the call with INVALID_ARGUMENT before that answer's Finish, and its
    thinker and talker streams are cancelled."""

    async def scenario():
        thinker, talker = FakeThinker(ANSWER * 20, delay_s=0.03), FakeTalker()
        async with TalkerServer(talker) as srv:
            client = Client(config(), text("Tell me a long story."))

            def on_event(event, events):
                if event.HasField("audio") and sum(e.HasField("audio") for e in events) == 2:
                    client.send(audio(_pcm(0.1), rate=64))

            with pytest.raises(InvalidRequest) as err:
                await converse(gateway(thinker, srv.address, media=FakeMedia()), client, on_event)
            await wait_until(lambda: talker.calls[0].cancelled, what="turn 0's Speak call cancelled")
        return thinker, talker, err.value

    thinker, talker, err = run(scenario())
    assert str(err).startswith("audio.sample_rate_hz: 64")
    assert thinker.calls[0].closed and not thinker.calls[0].finished  # the answer was not run to its end
    assert not talker.calls[0].completed


def test_a_malformed_message_while_the_answer_waits_for_a_talker_stream_ends_the_call_at_once():
    """The talker's only stream is busy with another call: the bad chunk is refused while that call
    still speaks (this call's text streams meanwhile, its audio waiting for the stream), not once this
    call's answer got a stream and ended; its wait for the stream ends with it."""

    async def scenario():
        thinker, talker = FakeThinker(ANSWER * 20, delay_s=0.03), FakeTalker()
        async with TalkerServer(talker) as srv:
            servicer = gateway(thinker, srv.address, media=FakeMedia(), max_streams=1)
            gate = servicer.pipeline.admission.gates["talker"]
            busy = Client(config(request_id="busy"), text("Talk for a while."))
            speaking = asyncio.create_task(converse(servicer, busy))
            await wait_until(lambda: talker.calls, what="the first call speaking")
            waiting = Client(config(request_id="waits"), text("Me too."))
            refused = asyncio.create_task(converse(servicer, waiting))
            await wait_until(lambda: gate.waiting == 1, what="a talker waiter")
            waiting.send(audio(_pcm(0.1), rate=64))
            with pytest.raises(InvalidRequest) as err:
                await refused
            still_speaking = not speaking.done() and not thinker.calls[0].finished
            waiters = gate.waiting
            busy.close()
            speaking.cancel()
            await asyncio.gather(speaking, return_exceptions=True)
        return err.value, still_speaking, len(talker.calls), waiters, servicer.pipeline.in_flight

    err, still_speaking, speak_calls, waiters, in_flight = run(scenario())
    assert str(err).startswith("audio.sample_rate_hz: 64") and still_speaking
    assert speak_calls == 1 and waiters == 0  # the refused call never spoke, and left the queue at once
    assert in_flight == 0


def test_the_history_keeps_at_most_max_turns_user_turns():
    async def scenario():
        thinker = FakeThinker("Ok. ")
        async with TalkerServer(FakeTalker()) as srv:
            servicer = gateway(thinker, srv.address, converse=ConverseLimits(max_turns=2))
            seeded = [
                omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Seed?")]),
                omni_pb2.ChatMessage(
                    role=omni_pb2.ROLE_ASSISTANT, parts=[omni_pb2.ContentPart(text="Seeded.")]
                ),
            ]
            client = Client(config(messages=seeded), text("A?"))
            sent = iter(["B?", "C?"])

            def on_event(event, events):
                if event.HasField("finish"):
                    nxt = next(sent, None)
                    client.send(text(nxt)) if nxt else client.close()

            await converse(servicer, client, on_event)
        return thinker

    prompts = [c.prompt for c in run(scenario()).calls]
    assert "Seed?" in prompts[0] and "Seeded." in prompts[0]
    assert "Seed?" not in prompts[1] and "A?" in prompts[1]
    assert "A?" not in prompts[2] and prompts[2].count("<role>HUMAN</role>") == 2


def test_a_history_past_the_thinkers_context_loses_its_oldest_turns():
    async def scenario():
        thinker = FakeThinker("Ok. ", max_user_turns=2)
        async with TalkerServer(FakeTalker()) as srv:
            client = Client(config(), text("A?"))
            sent = iter(["B?", "C?"])

            def on_event(event, events):
                if event.HasField("finish"):
                    nxt = next(sent, None)
                    client.send(text(nxt)) if nxt else client.close()

            events = await converse(gateway(thinker, srv.address), client, on_event)
        return thinker, events

    thinker, events = run(scenario())
    assert [f.finish.reason for f in finishes(events)] == [common_pb2.FINISH_REASON_STOP] * 3
    last = thinker.calls[-1].prompt
    assert "A?" not in last and "B?" in last and "C?" in last


def test_max_tokens_above_the_thinkers_context_fails_the_call_without_forgetting_the_history():
    """The thinker owns max_model_len: its refusal of max_tokens ends the call (the gateway checks only the
    sampling's shape), and is no reason to drop history turns and ask again."""
    refusal = "sampling.max_tokens: 5000 exceeds max_model_len 1024"
    seeded = [
        omni_pb2.ChatMessage(role=role, parts=[omni_pb2.ContentPart(text=t)])
        for role, t in ((omni_pb2.ROLE_USER, "Hi"), (omni_pb2.ROLE_ASSISTANT, "Hello"))
    ]

    async def scenario():
        thinker = FakeThinker("Ok. ", refuse=refusal)
        async with TalkerServer(FakeTalker()) as srv:
            client = Client(
                config(messages=seeded, sampling=common_pb2.SamplingParams(max_tokens=5000)), text("A?")
            )
            with pytest.raises(StageError) as err:
                await converse(gateway(thinker, srv.address), client)
        return thinker, err.value

    thinker, err = run(scenario())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and str(err) == f"thinker: {refusal}"
    assert len(thinker.calls) == 1  # asked once, with the whole history


LIMITS = ConverseLimits(max_turn_chars=20, max_turn_audio_bytes=64000, max_audio_seconds=1.5)


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([text("hi")], "config: required in the first message"),
        ([config(), config()], "config: only the first message may carry it"),
        (
            [config(), text("x" * 21)],
            "text: 21 characters, a text turn takes 1 to 20 (converse_max_turn_chars)",
        ),
        ([config(), audio(b"\0\0", rate=4000)], "audio.sample_rate_hz: 4000, expected 8000 to 48000"),
        (
            [config(), audio(b"\0\0"), audio(b"\0\0", rate=8000)],
            "audio.sample_rate_hz: 8000, the turn began at 16000",
        ),
        ([config(), END_OF_TURN], "end_of_turn: no audio before it"),
        ([config(), audio(b"\0\0"), text("hi")], "text: a spoken turn is still open"),
        (
            [config(), audio(b"\0\0\0"), END_OF_TURN],
            "audio.pcm16: the turn has 3 bytes, PCM16 needs an even number",
        ),
        ([config(), audio(b"\0" * 64002)], "audio.pcm16: the spoken turn passes 64000 bytes"),
        (
            [config(), audio(_pcm(1.6, 8000), rate=8000)],
            "audio.pcm16: the spoken turn passes the encoder's max_audio_seconds",
        ),
        ([config(), omni_pb2.ConverseRequest()], "ConverseRequest: empty message"),
        (
            [config(output_modalities=[omni_pb2.MODALITY_IMAGE])],
            "config.output_modalities[0]: Converse answers with text",
        ),
        (
            [
                config(
                    messages=[
                        omni_pb2.ChatMessage(
                            role=omni_pb2.ROLE_USER,
                            parts=[omni_pb2.ContentPart(image=omni_pb2.Media(data=b"png"))],
                        )
                    ]
                )
            ],
            "config.messages[0].parts[0]: the history",
        ),
        ([config(sampling=common_pb2.SamplingParams(temperature=1000))], "config.sampling.temperature"),
        (
            [config(voice="a", custom_voice=omni_pb2.VoiceClip(audio=b"x", transcript="y"))],
            "config.custom_voice: set voice or custom_voice, not both",
        ),
        ([config(voice="nobody"), text("hi")], "config.voice: unknown voice 'nobody'"),
    ],
    ids=[
        "no-config",
        "config-twice",
        "long-text",
        "low-rate",
        "rate-change",
        "empty-turn",
        "text-in-spoken-turn",
        "odd-pcm",
        "turn-bytes",
        "turn-seconds",
        "empty-message",
        "image-out",
        "history-media",
        "sampling",
        "two-voices",
        "unknown-voice",
    ],
)
def test_bad_input_ends_the_call_naming_the_field(messages, needle):
    async def scenario():
        talker = FakeTalker("refuse-voice" if needle.startswith("config.voice") else "echo")
        async with TalkerServer(talker) as srv:
            servicer = gateway(
                FakeThinker(ANSWER, delay_s=0.02), srv.address, media=FakeMedia(), converse=LIMITS
            )
            client = Client(*messages)
            with pytest.raises(OmniError) as err:
                await converse(servicer, client)
            return err.value, servicer.pipeline.in_flight

    err, in_flight = run(scenario())
    assert isinstance(err, InvalidRequest) and str(err).startswith(needle), str(err)
    assert in_flight == 0


def test_without_a_talker_converse_is_failed_precondition_naming_it():
    async def scenario():
        with pytest.raises(StageUnavailable) as err:
            await converse(gateway(FakeThinker(), None), Client(config(), text("hi")))
        return err.value

    err = run(scenario())
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "'talker'" in str(err)


TEXT_ONLY = [omni_pb2.MODALITY_TEXT]


def test_a_text_only_conversation_needs_no_talker():
    """output_modalities [MODALITY_TEXT]: turns answered with text from the history, no audio, no
    AudioStatus (no speech was asked for), a barge-in still interrupts; no talker deployed at all."""

    async def scenario():
        thinker = FakeThinker(ANSWER * 20, delay_s=0.02)
        client = Client(config(output_modalities=TEXT_ONLY, voice="DB30"), text("Tell me a long story."))

        def on_event(event, events):
            if event.HasField("text") and event.turn == 0 and sum(e.HasField("text") for e in events) == 3:
                thinker.answer = ANSWER  # the next call's
                client.send(text("Stop, please."))
            if event.HasField("finish") and event.turn == 1:
                client.close()

        servicer = gateway(thinker, None)
        events = await converse(servicer, client, on_event)
        return thinker, events, servicer.pipeline.in_flight

    thinker, events, in_flight = run(scenario())
    assert {e.WhichOneof("event") for e in events} == {"text", "finish"}
    first, second = finishes(events)
    assert (first.turn, first.finish.reason, first.finish.message) == (
        0,
        common_pb2.FINISH_REASON_INTERRUPTED,
        "interrupted by user turn 1",
    )
    assert (second.turn, second.finish.reason) == (1, common_pb2.FINISH_REASON_STOP)
    assert not first.finish.HasField("audio") and not second.finish.HasField("audio")
    assert turn_text(events, 1) == ANSWER and thinker.calls[0].closed and not thinker.calls[0].finished
    assert thinker.calls[1].prompt.endswith(
        f"{turn_text(events, 0)}<|role_end|><role>HUMAN</role>Stop, please.<|role_end|><role>ASSISTANT</role>"
    )
    assert in_flight == 0


def test_a_text_only_conversation_does_not_call_a_deployed_talker():
    async def scenario():
        talker = FakeTalker()
        async with TalkerServer(talker) as srv:
            client = Client(config(output_modalities=TEXT_ONLY), text("Hi?"))
            client.close()
            events = await converse(gateway(FakeThinker(ANSWER), srv.address), client)
        return talker, events

    talker, events = run(scenario())
    assert turn_text(events, 0) == ANSWER and talker.calls == []
    assert [e.finish.reason for e in finishes(events)] == [common_pb2.FINISH_REASON_STOP]


def test_spoken_turns_without_an_encoder_are_failed_precondition_naming_it():
    async def scenario():
        async with TalkerServer(FakeTalker()) as srv:
            with pytest.raises(StageUnavailable) as err:
                await converse(gateway(FakeThinker(), srv.address), Client(config(), audio(b"\0\0")))
        return err.value

    err = run(scenario())
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and str(err).startswith(
        "audio: spoken turns need the 'encoder'"
    )


def test_spoken_conversations_wait_for_a_talker_stream_and_all_speak():
    """Two conversations on a talker of one stream: the second turn's answer waits for it, then speaks."""

    async def scenario():
        talker = FakeTalker()
        async with TalkerServer(talker) as srv:
            servicer = gateway(FakeThinker(ANSWER, delay_s=0.02), srv.address, max_streams=1)
            clients = [Client(config(), text("Hi?")) for _ in range(2)]
            for client in clients:
                client.close()
            calls = await asyncio.gather(*(converse(servicer, client) for client in clients))
        return calls, talker.most_active

    calls, most_active = run(scenario())
    for events in calls:
        (done,) = finishes(events)
        assert done.finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE and turn_text(events, 0) == ANSWER
    assert most_active == 1


@pytest.mark.parametrize(
    ("reason", "kept"),
    [
        (common_pb2.FINISH_REASON_STOP, (1, 2)),  # the stop token (3) left out
        (common_pb2.FINISH_REASON_LENGTH, (1, 2, 3)),
        (common_pb2.FINISH_REASON_STOP_STRING, ()),  # the ids say more than the client saw: text only
        (common_pb2.FINISH_REASON_UNSPECIFIED, ()),  # interrupted before its finish
    ],
)
def test_the_history_keeps_a_complete_answer_as_its_generated_ids(reason, kept):
    answer = _Answer(["Hi", " you"], token_ids=[1, 2, 3], reason=reason)
    assert answer.entry() == Entry("assistant", "Hi you", token_ids=kept)


def test_a_stage_error_that_comes_with_the_calls_cancellation_is_not_left_unretrieved():
    """The encoder's DEADLINE_EXCEEDED and the call's own cancellation in one loop turn: no
    'Task exception was never retrieved' (asyncio logs it through the loop's exception handler)."""
    import gc

    from omnistage.services.gateway.run import RequestRun

    async def main() -> list[dict]:
        loop = asyncio.get_running_loop()
        unhandled: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
        gate = loop.create_future()

        async def stage():
            await gate
            raise StageError(
                "encoder",
                grpc.aio.AioRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    "Deadline Exceeded",
                ),
            )

        async def consume():
            async with RequestRun("r", 4) as run:
                run.start(stage(), "answer")
                async for _ in run.events():
                    pass

        consumer = asyncio.create_task(consume())
        for _ in range(5):
            await asyncio.sleep(0)
        gate.set_result(None)  # the encoder's error ...
        consumer.cancel()  # ... and the call's deadline, together
        await asyncio.gather(consumer, return_exceptions=True)
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
        return unhandled

    unhandled = run(main())
    assert not [c for c in unhandled if "never retrieved" in c.get("message", "")], unhandled
