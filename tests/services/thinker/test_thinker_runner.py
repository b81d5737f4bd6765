"""ThinkerRunner on the DeviceLoop: every stream gets its end — aborted, failed or stopped."""

from __future__ import annotations

import asyncio
import threading

from omnistage.common.runtime.device_loop import DeviceFailed, DeviceLoop, DeviceStopped
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams
from omnistage.services.thinker.runner import ThinkerRunner
from omnistage.services.thinker.tp.distributed import TPError

from tests.services.thinker.engine.engine_fakes import make_fake_engine, slow_steps


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
