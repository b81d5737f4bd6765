"""ThinkerRunner on the DeviceLoop: every stream gets its end — aborted, failed or stopped; arrivals
together are one batch (adds queued during a step join the next one; an idle engine's first step waits,
bounded, for the requests on their way)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from omnistage.common.runtime.device_loop import DeviceFailed, DeviceLoop, DeviceStopped
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams
from omnistage.services.thinker.runner import ThinkerRunner
from omnistage.services.thinker.tp.distributed import TPError

from tests.services.thinker.engine.engine_fakes import make_fake_engine, slow_steps
from tests.waits import wait_for_async


def slow_engine(step_s: float = 0.02):
    """A fake engine whose steps take `step_s`, so a request lives long enough to be aborted mid-way."""
    return slow_steps(make_fake_engine(block_size=8, max_model_len=256), step_s)


def thinker_loop(engine) -> tuple[ThinkerRunner, DeviceLoop]:
    runner = ThinkerRunner(engine, asyncio.get_running_loop())
    return runner, DeviceLoop(
        "engine", runner, idle_wait_s=0.05, describe_failure=str, quiet_failures=(TPError,)
    )


async def _add(loop: DeviceLoop, runner: ThinkerRunner, request_id: str, max_tokens: int) -> asyncio.Queue:
    stream: asyncio.Queue = asyncio.Queue()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    budget = runner.engine.budget([1, 2, 3], params)  # made where the request is made
    await asyncio.wrap_future(loop.call(lambda: runner.add(request_id, [1, 2, 3], params, budget, stream)))
    return stream


async def _until_end(stream, timeout_s: float = 5.0):
    while True:
        out = await asyncio.wait_for(stream.get(), timeout_s)
        if isinstance(out, BaseException) or out.finished:
            return out


def test_abort_delivers_a_final_abort_output_to_the_stream():
    async def scenario():
        engine = slow_engine()
        runner, loop = thinker_loop(engine)
        loop.start()
        try:
            stream = await _add(loop, runner, "a", 240)
            first = await asyncio.wait_for(stream.get(), 5)
            assert not first.finished
            aborted = await asyncio.wrap_future(loop.call(lambda: runner.abort("a")))
            assert aborted.finish_reason is FinishReason.ABORT
            last = await _until_end(stream)
            assert last.finished and last.finish_reason is FinishReason.ABORT
            assert 1 <= last.usage.completion_tokens < 240
            assert not engine.has_unfinished() and not runner._streams
            assert await asyncio.wrap_future(loop.call(lambda: runner.abort("a"))) is None  # already gone
        finally:
            loop.stop()

    asyncio.run(scenario())


def test_a_failed_step_ends_every_stream_with_the_groups_message_and_tells_health():
    async def scenario():
        engine = slow_engine()
        runner, loop = thinker_loop(engine)
        heard: list[DeviceFailed] = []
        loop.on_failure.append(heard.append)
        real_step, fail_now = engine.step, threading.Event()

        def step():
            if fail_now.is_set():
                raise RuntimeError("rank 1 died while serving (step 3): process 42 is gone")
            return real_step()

        engine.step = step
        loop.start()
        try:
            streams = [await _add(loop, runner, rid, 240) for rid in ("a", "b")]
            await asyncio.wait_for(streams[0].get(), 5)
            fail_now.set()
            for stream in streams:
                end = await _until_end(stream)
                assert isinstance(end, DeviceFailed)
                assert str(end) == "rank 1 died while serving (step 3): process 42 is gone"
            refused = loop.call(lambda: runner.abort("a"))
            assert isinstance(refused.exception(5), DeviceFailed)
        finally:
            loop.stop()
        assert len(heard) == 1 and isinstance(heard[0].cause, RuntimeError)

    asyncio.run(scenario())


def test_stop_ends_open_streams_and_shuts_the_engine_down():
    async def scenario():
        engine = slow_engine()
        shut: list[str] = []
        real_shutdown = engine.shutdown
        engine.shutdown = lambda: (shut.append("shutdown"), real_shutdown())
        runner, loop = thinker_loop(engine)
        loop.start()
        stream = await _add(loop, runner, "a", 240)
        await asyncio.wait_for(stream.get(), 5)
        await asyncio.get_running_loop().run_in_executor(None, loop.stop)
        end = await _until_end(stream)
        assert isinstance(end, DeviceStopped) and shut == ["shutdown"]

    asyncio.run(scenario())


# -- arrivals together are one batch ---------------------------------------------------------------


def _queue_add(runner: ThinkerRunner, request_id: str) -> asyncio.Queue:
    """`runner.add` on this thread (a test driving the runner by hand, as the device thread would)."""
    stream: asyncio.Queue = asyncio.Queue()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runner.add(request_id, [1, 2, 3], params, runner.engine.budget([1, 2, 3], params), stream)
    return stream


def test_an_idle_engines_first_step_waits_for_the_requests_on_their_way_then_takes_them_all():
    async def scenario():
        now = [100.0]
        engine = make_fake_engine(block_size=8, max_model_len=256)
        runner = ThinkerRunner(engine, asyncio.get_running_loop(), gather_s=0.005, clock=lambda: now[0])
        with runner.arrivals.coming() as a, runner.arrivals.coming() as b, runner.arrivals.coming() as c:
            a.here()
            _queue_add(runner, "a")
            assert not runner.has_work() and runner.wake_in() == pytest.approx(0.005)
            now[0] += 0.004
            b.here()
            _queue_add(runner, "b")
            assert not runner.has_work() and runner.wake_in() == pytest.approx(0.001)  # c is on its way
            c.here()
            _queue_add(runner, "c")
        assert runner.has_work() and runner.wake_in() is None
        assert runner.step() == 3  # one prefill step, each of the three its first token

    asyncio.run(scenario())


def test_a_request_alone_a_busy_engine_and_a_hold_past_its_bound_never_wait():
    async def scenario():
        now = [100.0]
        engine = make_fake_engine(block_size=8, max_model_len=256)
        runner = ThinkerRunner(engine, asyncio.get_running_loop(), gather_s=0.005, clock=lambda: now[0])
        with runner.arrivals.coming() as a:
            a.here()
            _queue_add(runner, "a")  # nobody else on the way
            assert runner.has_work()
        with runner.arrivals.coming():  # b is on its way, but a is stepped already: no hold
            runner.step()
            _queue_add(runner, "c")
            assert runner.has_work()
        while runner.has_work():
            runner.step()
        with runner.arrivals.coming():  # idle again, d's first step holds for e until the bound
            _queue_add(runner, "d")
            assert not runner.has_work()
            now[0] += 0.005
            assert runner.has_work() and runner.wake_in() is None
        off = ThinkerRunner(engine, asyncio.get_running_loop(), gather_s=0.0)
        while off.has_work():
            off.step()
        with off.arrivals.coming():
            _queue_add(off, "f")
            assert off.has_work()  # gather_s = 0: never held

    asyncio.run(scenario())


def test_the_device_loop_is_woken_when_the_last_request_on_its_way_arrives_or_is_refused():
    engine = make_fake_engine(block_size=8, max_model_len=256)
    runner = ThinkerRunner(engine, asyncio.new_event_loop(), gather_s=0.005)
    woken: list[int] = []
    runner.arrivals.wake = lambda: woken.append(runner.arrivals.count)
    with runner.arrivals.coming() as a, runner.arrivals.coming():
        a.here()
        a.here()  # once only
        assert runner.arrivals.count == 1 and woken == []
    # the second left the block without a `here()` (refused, cancelled): counted off, the loop woken
    assert runner.arrivals.count == 0 and woken == [0]


def test_adds_queued_while_a_step_runs_all_join_the_next_step():
    """The device loop runs every add queued before a step: requests that arrive while a step runs are
    prefilled together in the next one, not one step each."""

    async def scenario():
        engine = make_fake_engine(block_size=8, max_model_len=256)
        stepped: list[set[str]] = []
        entered, go = threading.Event(), threading.Event()
        real_step = engine.step

        def step():
            entered.set()
            go.wait(10)
            outputs = real_step()
            stepped.append({o.request_id for o in outputs})
            return outputs

        engine.step = step
        runner, loop = thinker_loop(engine)
        loop.start()
        try:
            first = await _add(loop, runner, "a", 8)
            await asyncio.to_thread(entered.wait, 10)  # a's first step runs (held)
            later = [asyncio.ensure_future(_add(loop, runner, rid, 8)) for rid in "bcde"]
            await asyncio.sleep(0)  # every add queued while the step runs
            await wait_for_async(lambda: len(loop._calls) == 4, 10, "the four adds queued")
            go.set()
            await asyncio.gather(*later)
            await _until_end(first)
            assert stepped[0] == {"a"} and stepped[1] == {"a", "b", "c", "d", "e"}
        finally:
            go.set()
            loop.stop()

    asyncio.run(scenario())
