"""One RequestRun per request (issue 41): its stages push events into one bounded queue, the servicer
reads the run's events (the only generator between them: an audio chunk passes at most three
generator frames in the gateway), `cancel` ends every stage call at once, a stage's error fails the
run, and Converse creates no task per streamed event."""

from __future__ import annotations

import asyncio
import gc
import inspect

import pytest
from omnistage.services.gateway.run import RequestRun
from omnistage.v1 import common_pb2, omni_pb2

from tests.services.gateway.gateway_speech_fakes import (
    Context,
    FakeTalker,
    FakeThinker,
    TalkerServer,
    gateway,
    wait_until,
)
from tests.services.gateway.leftovers import GATEWAY_CODE
from tests.services.gateway.test_gateway_speech import ANSWER, request


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def gateway_generators(agen) -> list[str]:
    """The gateway's async generators a suspended async generator waits through, outermost first (its
    `ag_await` chain: an `async for` over another generator awaits that one's asend object)."""
    names, obj = [], agen
    while obj is not None:
        if inspect.isasyncgen(obj):
            if GATEWAY_CODE in obj.ag_code.co_filename:
                names.append(obj.ag_code.co_qualname)
            obj = obj.ag_await
        elif inspect.iscoroutine(obj):
            obj = obj.cr_await
        elif type(obj).__name__ == "async_generator_asend":
            obj = next((r for r in gc.get_referents(obj) if inspect.isasyncgen(r)), None)
        else:
            break
    return names


def test_an_audio_chunk_passes_at_most_three_generator_frames_in_the_gateway():
    """Between the servicer and a chunk leaving, the generators the client's read waits through: the
    servicer's and the run's (on main: Generate, record, Pipeline.generate, Pipeline.answer,
    SpokenAnswer.events)."""

    async def scenario():
        talker = FakeTalker(speak_delay_s=0.3)
        async with TalkerServer(talker) as srv:
            stream = gateway(FakeThinker(ANSWER, delay_s=0.3), srv.address).Generate(request(), Context())
            async for event in stream:
                if event.HasField("audio"):
                    break
            waiting = asyncio.ensure_future(anext(stream))
            await wait_until(
                lambda: gateway_generators(stream)[-1:] != ["OmniServicer.Generate"], what="a read"
            )
            chain = gateway_generators(stream)
            await waiting
            async for _ in stream:
                pass
        return chain

    chain = run(scenario())
    assert chain[0] == "OmniServicer.Generate" and len(chain) <= 3, chain


async def _converse_tasks(answer: str) -> tuple[int, int]:
    """(tasks created, events streamed) of one text-only Converse turn answered with `answer`."""
    created = 0
    loop = asyncio.get_running_loop()

    def factory(loop, coro, **kw):
        nonlocal created
        created += 1
        return asyncio.Task(coro, loop=loop, **kw)

    async def requests():
        sampling = common_pb2.SamplingParams(max_tokens=256)
        config = omni_pb2.GenerateRequest(output_modalities=[omni_pb2.MODALITY_TEXT], sampling=sampling)
        yield omni_pb2.ConverseRequest(config=config)
        yield omni_pb2.ConverseRequest(text="Hi?")

    servicer = gateway(FakeThinker(answer, delay_s=0.001), None)
    loop.set_task_factory(factory)
    try:
        events = [e async for e in servicer.Converse(requests(), Context())]
    finally:
        loop.set_task_factory(None)
    return created, len(events)


def test_converse_creates_no_task_per_streamed_event():
    async def scenario():
        return await _converse_tasks("One two. "), await _converse_tasks("One two. " * 20)

    (short_tasks, short_events), (long_tasks, long_events) = run(scenario())
    assert long_events > short_events + 30
    assert long_tasks == short_tasks  # on main: three more for every text delta


def _event(text: str) -> omni_pb2.GenerateEvent:
    return omni_pb2.GenerateEvent(text=omni_pb2.TextDelta(text=text))


def test_cancel_ends_every_stage_of_the_run_at_once_and_drops_what_was_not_read():
    async def scenario():
        ended: list[str] = []

        async def stage(name: str) -> None:
            try:
                for i in range(100):
                    await run_.emit(_event(f"{name}{i}"))
            except asyncio.CancelledError:
                ended.append(name)
                raise

        async with RequestRun("r", 4) as run_:
            run_.on_end(lambda: ended.append("released"))
            run_.start(stage("a"), "a")
            run_.start(stage("b"), "b")
            events = run_.events()
            first = await anext(events)
            await asyncio.sleep(0.01)  # both stages wait: the queue holds 4 events
            run_.cancel("interrupted by user turn 1")
            rest = [e async for e in events]
        return first, rest, ended, run_.cancelled

    first, rest, ended, reason = run(scenario())
    assert first.text.text in ("a0", "b0") and rest == []  # what was queued is dropped
    assert sorted(ended[:2]) == ["a", "b"] and ended[2:] == ["released"]
    assert reason == "interrupted by user turn 1"


def test_a_stage_error_fails_the_run_and_cancels_the_others():
    async def scenario():
        cancelled = asyncio.Event()

        async def failing() -> None:
            await run_.emit(_event("x"))
            raise ValueError("broken stage")

        async def other() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async with RequestRun("r", 4) as run_:
            run_.start(other(), "other")
            run_.start(failing(), "failing")
            with pytest.raises(ValueError, match="broken stage"):
                async for _ in run_.events():
                    pass
            await asyncio.wait_for(cancelled.wait(), 5)

    run(scenario())


def test_a_slow_reader_holds_the_stages_at_the_runs_bound():
    async def scenario():
        emitted = 0

        async def stage() -> None:
            nonlocal emitted
            for i in range(50):
                await run_.emit(_event(str(i)))
                emitted += 1
            await run_.finish(omni_pb2.GenerateEvent(finish=omni_pb2.Finish()))

        async with RequestRun("r", 3) as run_:
            run_.start(stage(), "stage")
            await asyncio.sleep(0.05)
            held = emitted
            events = [e async for e in run_.events()]
        return held, events

    held, events = run(scenario())
    assert held == 3 and len(events) == 51 and events[-1].HasField("finish")


def test_audio_dropped_by_a_cancel_is_not_counted_as_sent():
    async def scenario():
        chunk = omni_pb2.AudioChunk(pcm16=b"\x01\x00" * 10, sample_rate_hz=100)
        async with RequestRun("r", 8) as run_:
            run_.audio = omni_pb2.AudioStatus()
            for _ in range(3):
                await run_.emit(omni_pb2.GenerateEvent(audio=chunk))
            events = run_.events()
            await anext(events)
            run_.cancel("cancelled by the client")
            return run_.audio.samples

    assert run(scenario()) == 10  # the one chunk read; the two dropped do not count
