"""Every Speak call a spoken answer opens is over when the answer is, whoever ended it: the talker
(finished, refused, full, failed, "nothing to speak"), the thinker before the talker, or the client
(left mid-answer, cancelled), in Generate, in Converse with barge-ins, and in the gateway's warm-up.
Nothing of it is left to the garbage collector: no task still pending (grpc's reader of the call's
requests, the answer's own tasks), no async generator closed under a running iteration, which
asyncio reports as "Task was destroyed but it is pending!" and "Task exception was never retrieved"
(aclose(): asynchronous generator is already running), and no gateway generator left for asyncio's
finalizer to close.

Run with and without the deployment's stage key: with it every stage channel has grpc's client
interceptors, which turn a call's write()/done_writing() into a queue-fed async generator read by a
task of grpc's; a call the talker ended before the gateway half-closed left that task waiting forever.
"""

from __future__ import annotations

import asyncio

import pytest
from omnistage.common.runtime.auth import STAGE_KEY_ENV, STAGE_KEY_OFF
from omnistage.services.gateway.outputs.talker import SpeechLimits
from omnistage.services.gateway.stages import TalkerClient
from omnistage.v1 import common_pb2, omni_pb2

from tests.services.gateway.gateway_speech_fakes import (
    Context,
    FakeTalker,
    FakeThinker,
    TalkerServer,
    gateway,
    wait_until,
)
from tests.services.gateway.leftovers import Leftovers
from tests.services.gateway.test_gateway_speech import ANSWER, request, run

# A talker for each way a Speak call can end on its side ("slow": the thinker finishes long before it).
TALKERS = {
    "echo": lambda: FakeTalker(),
    "slow": lambda: FakeTalker(speak_delay_s=0.01),
    "refuse-voice": lambda: FakeTalker("refuse-voice"),
    "busy": lambda: FakeTalker("busy"),
    "fail-after-audio": lambda: FakeTalker("fail-after-audio"),
    "broken-after-audio": lambda: FakeTalker("broken-after-audio"),
    "nothing": lambda: FakeTalker("nothing"),
}
# How the clients of one run read their answers, all at once.
CLIENTS = ("whole", "whole", "whole", "leaves", "leaves", "cancelled")


@pytest.fixture(params=[False, True], ids=["no-stage-key", "stage-key"])
def stage_key(request, monkeypatch):
    """The stage channels with the stage key's interceptors (as `omnistage serve` runs them) or without."""
    monkeypatch.setenv(STAGE_KEY_ENV, "k" * 32 if request.param else STAGE_KEY_OFF)
    return request.param


async def _client(servicer, how: str) -> str:
    """One spoken request read as `how` says: to its end, left after the first event, or cancelled."""
    events = servicer.Generate(request(voice="DB30"), Context())
    try:
        if how == "cancelled":
            reading = asyncio.ensure_future(anext(events))
            await reading
            reading = asyncio.ensure_future(anext(events))
            await asyncio.sleep(0)  # the read has begun: cancelled while it waits in the answer
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            return "cancelled"
        async for event in events:
            if how == "leaves" or event.HasField("finish"):
                return event.WhichOneof("event")
        return "no finish"
    except Exception as exc:  # noqa: BLE001 - a refused voice fails the request: one of the outcomes
        return type(exc).__name__
    finally:
        await events.aclose()


async def _answers(
    talker: FakeTalker, thinker: FakeThinker, left: Leftovers
) -> tuple[list[str], list[str], int]:
    """Every client of CLIENTS at once on one gateway; once the answers are over, what is left: the
    Speak calls the gateway still holds, the pending tasks (each given a deadline to end), and the
    Speak handlers still running in the talker."""
    async with TalkerServer(talker) as srv:
        servicer = gateway(thinker, srv.address, limits=SpeechLimits(start_wait_s=5.0, idle_timeout_s=5.0))
        client: TalkerClient = servicer.pipeline.speech.talker
        outcomes = await asyncio.gather(*(_client(servicer, how) for how in CLIENTS))
        await wait_until(lambda: talker.active == 0, what="every Speak handler in the talker to return")
        await left.no_task_left()
        in_flight = client.calls_in_flight
        await client.close()
    return outcomes, left.pending(), in_flight


@pytest.mark.parametrize("mode", list(TALKERS))
def test_every_speak_call_ends_with_its_answer_and_leaves_nothing_to_the_gc(stage_key, mode):
    async def scenario():
        left = Leftovers()
        talker = TALKERS[mode]()
        outcomes, pending, in_flight = await _answers(talker, FakeThinker(ANSWER, delay_s=0.002), left)
        return talker, outcomes, pending, in_flight, await left.collected()

    talker, outcomes, pending, in_flight, reports = run(scenario())
    assert reports == []
    assert pending == [] and in_flight == 0
    assert len(talker.calls) == len(CLIENTS) and talker.active == 0  # each stream opened, and ended
    whole = outcomes[: CLIENTS.count("whole")]
    assert whole == (["InvalidRequest"] * 3 if mode == "refuse-voice" else ["finish"] * 3), outcomes
    if mode in ("echo", "slow"):  # the talker got the whole text, end_of_text, and finished those three
        assert sum(c.completed for c in talker.calls) >= 3
        assert all(c.completed or c.cancelled for c in talker.calls)


def test_the_talker_warm_up_leaves_nothing_to_the_gc(stage_key):
    from omnistage.services.gateway.outputs.talker import warm_up_talker as _warm_up_talker

    async def scenario():
        left = Leftovers()
        talker = FakeTalker()
        async with TalkerServer(talker) as srv:
            client = TalkerClient("talker", srv.address, 1 << 22)
            await _warm_up_talker(client)
            await wait_until(lambda: talker.active == 0, what="the warm-up's Speak handler to return")
            await left.no_task_left()
            await client.close()
        return talker, await left.collected()

    talker, reports = run(scenario())
    assert reports == []
    (call,) = talker.calls
    assert call.texts == ["Warm-up."] and call.end_of_text and call.completed


async def _turns(*texts: str):
    """A Converse client's messages: the config, then its text turns back to back (each interrupts the
    answer before it), then the half-close."""
    sampling = common_pb2.SamplingParams(max_tokens=16, seed=3)
    yield omni_pb2.ConverseRequest(
        config=omni_pb2.GenerateRequest(request_id="c1", voice="DB30", sampling=sampling)
    )
    for t in texts:
        yield omni_pb2.ConverseRequest(text=t)


@pytest.mark.parametrize("mode", ["echo", "refuse-voice", "busy", "fail-after-audio"])
def test_a_conversation_with_barge_ins_leaves_nothing_to_the_gc(stage_key, mode):
    async def scenario():
        left = Leftovers()
        talker = TALKERS[mode]()
        async with TalkerServer(talker) as srv:
            servicer = gateway(
                FakeThinker(ANSWER * 4, delay_s=0.002),
                srv.address,
                limits=SpeechLimits(start_wait_s=5.0, idle_timeout_s=5.0),
            )
            events, error = [], None
            try:
                async for event in servicer.Converse(_turns("One?", "Two?", "Three?"), Context()):
                    events.append(event)
            except Exception as exc:  # noqa: BLE001 - a refused voice ends the call
                error = type(exc).__name__
            await wait_until(lambda: talker.active == 0, what="every Speak handler in the talker to return")
            await left.no_task_left()
            in_flight = servicer.pipeline.speech.talker.calls_in_flight
            await servicer.pipeline.speech.talker.close()
        return talker, events, error, in_flight, left.pending(), await left.collected()

    talker, events, error, in_flight, pending, reports = run(scenario())
    assert reports == []
    assert pending == [] and in_flight == 0 and talker.active == 0
    if mode == "refuse-voice":
        assert error == "InvalidRequest" and len(talker.calls) == 1
    else:
        assert error is None
        assert [e.turn for e in events if e.HasField("finish")] == [0, 1, 2]
        assert len(talker.calls) >= 1
