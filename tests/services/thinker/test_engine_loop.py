"""EngineLoop: the thread that drives the engine hands every stream its end, aborted or not."""

from __future__ import annotations

import asyncio
import time

from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams
from omnistage.services.thinker.engine_loop import EngineLoop

from tests.services.thinker.engine.engine_fakes import make_fake_engine


def slow_engine(step_s: float = 0.02):
    """A fake engine whose steps take `step_s`, so a request lives long enough to be aborted mid-way."""
    engine = make_fake_engine(block_size=8, max_model_len=256)
    real_step = engine.step

    def step():
        time.sleep(step_s)
        return real_step()

    engine.step = step
    return engine


async def _until_finished(stream, timeout_s: float = 5.0):
    while True:
        out = await asyncio.wait_for(stream.get(), timeout_s)
        if isinstance(out, BaseException) or out.finished:
            return out


def test_abort_delivers_a_final_abort_output_to_the_stream():
    async def scenario():
        engine = slow_engine()
        loop = EngineLoop(engine, asyncio.get_running_loop(), idle_poll_s=0.05)
        loop.start()
        try:
            stream = await loop.submit("a", [1, 2, 3], SamplingParams(max_tokens=240, ignore_eos=True))
            first = await asyncio.wait_for(stream.get(), 5)
            assert not first.finished
            aborted = await asyncio.wrap_future(loop.abort("a"))
            assert aborted.finish_reason is FinishReason.ABORT
            last = await _until_finished(stream)
            assert last.finished and last.finish_reason is FinishReason.ABORT
            assert 1 <= last.usage.completion_tokens < 240
            assert not engine.has_unfinished() and not loop._streams
            assert await asyncio.wrap_future(loop.abort("a")) is None  # already gone: nothing to end
        finally:
            loop.stop()

    asyncio.run(scenario())
