"""ImageGenEngine + ImageGenRunner in one process (no gRPC): progress events == steps, requests of one
shape join each other at step boundaries, a cancelled request leaves the loop and frees its slot, a
full service refuses with RESOURCE_EXHAUSTED, a failed forward fails only its requests; a request's
queue time is observed once, as it enters the denoising loop, and never for one that left before."""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time

import pytest
import torch
from omnistage.common.config import ImageGenConfig
from omnistage.common.metrics import REGISTRY
from omnistage.common.runtime.errors import Overloaded
from omnistage.common.transport import TransportContext
from omnistage.services.imagegen.pipeline import GenerationSpec
from omnistage.services.imagegen.request import ParsedRequest
from omnistage.services.imagegen.request_flow import ImageGenEngine, ImageResult
from omnistage.services.imagegen.runner import Progress
from PIL import Image

pytestmark = pytest.mark.timeout(120)
SMALL = (64, 96)


def _parsed(steps: int, seed: int = 0, bucket: tuple[int, int] = SMALL) -> ParsedRequest:
    cond = torch.randn(256, 256, generator=torch.Generator().manual_seed(seed))
    return ParsedRequest(GenerationSpec(cond, bucket, steps, 2.0, seed), width=bucket[1], height=bucket[0])


@contextlib.asynccontextmanager
async def _engine(pipeline, cap: int = 2, service: str = "imagegen-test", on_failure=None, **cfg):
    with TransportContext() as transport:
        engine = ImageGenEngine(
            pipeline, ImageGenConfig(**cfg), transport, cap, service=service, on_failure=on_failure
        )
        engine.start()
        try:
            yield engine
        finally:
            engine.stop()


async def _collect(engine, parsed, timeout_s: float = 60.0) -> list:
    return [ev async for ev in engine.generate(parsed, timeout_s=timeout_s)]


async def _wait_until(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _cancelled() -> float:
    value = REGISTRY.get_sample_value("omnistage_imagegen_cancelled_total", {"service": "imagegen-full"})
    return value or 0.0


def test_a_progress_event_per_step_then_the_image(pipeline):
    async def run():
        async with _engine(pipeline) as engine:
            return await _collect(engine, _parsed(4, seed=3))

    events = asyncio.run(run())
    assert [(e.step, e.total) for e in events[:-1]] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    result = events[-1]
    assert isinstance(result, ImageResult) and result.seed == 3 and result.steps == 4
    assert Image.open(io.BytesIO(result.png)).size == (SMALL[1], SMALL[0])


def test_a_later_request_joins_at_a_step_boundary(pipeline):
    async def run():
        async with _engine(pipeline) as engine:
            first = engine.generate(_parsed(40, seed=1), timeout_s=60)
            events = [await anext(first), await anext(first)]  # two steps done alone
            second = asyncio.create_task(_collect(engine, _parsed(3, seed=2)))
            events += [ev async for ev in first]
            return engine.loop, events, await second

    loop, first, second = asyncio.run(run())
    assert len(first) == 41 and len(second) == 4
    assert loop.largest_batch == 2  # the second request shared forwards with the first
    assert loop.steps < 39 + 2  # fewer forwards than moving steps (39 + 2) run one by one


def test_different_shapes_take_turns(pipeline):
    async def run():
        async with _engine(pipeline) as engine:
            return await asyncio.gather(
                _collect(engine, _parsed(3, 1)), _collect(engine, _parsed(3, 2, (96, 64)))
            )

    a, b = asyncio.run(run())
    assert isinstance(a[-1], ImageResult) and isinstance(b[-1], ImageResult)
    assert a[-1].bucket == SMALL and b[-1].bucket == (96, 64)


def test_cancel_leaves_the_loop_and_frees_the_slot(pipeline):
    async def run():
        async with _engine(pipeline, cap=1) as engine:
            gen = engine.generate(_parsed(200, seed=4), timeout_s=60)
            assert isinstance(await anext(gen), Progress)
            await gen.aclose()  # what a client cancel does to the servicer's stream
            await _wait_until(lambda: engine.runner.held == 0 and engine.limiter.in_use == 0, "the drop")
            assert engine.runner.dropped == 1 and engine.load() == (0, 0)
            return await _collect(engine, _parsed(2, seed=5))  # the one slot is free again

    assert isinstance(asyncio.run(run())[-1], ImageResult)


def test_a_request_that_leaves_while_waiting_for_a_slot_never_reaches_the_device(pipeline, monkeypatch):
    """The caller's cancel also cancelled the future its holder was to fulfil; the holder went on
    waiting, took the slot when it came free, handed the job to the device thread anyway and let go of
    the slot at once (more than the tested batch could run)."""

    async def run():
        async with _engine(pipeline, cap=1) as engine:
            submitted = []
            real_put = engine.runner.put
            monkeypatch.setattr(engine.runner, "put", lambda job: (submitted.append(job), real_put(job)))
            first = engine.generate(
                _parsed(2000, seed=1), timeout_s=60
            )  # holds the slot well past the cancel
            await anext(first)
            second = asyncio.create_task(_collect(engine, _parsed(2, seed=2)))
            await _wait_until(lambda: engine.limiter.waiting == 1, "the second request to wait for the slot")
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            await _wait_until(lambda: engine.limiter.waiting == 0, "the waiting request to be gone")
            assert engine.limiter.in_use == 1
            await first.aclose()
            await _wait_until(
                lambda: engine.load() == (0, 0) and engine.limiter.in_use == 0, "an idle engine"
            )
            await asyncio.sleep(0.1)  # a holder left behind would take the free slot now
            return len(submitted), engine.load()

    assert asyncio.run(run()) == (1, (0, 0))


def test_full_service_refuses(pipeline):
    async def run():
        async with _engine(
            pipeline, cap=1, service="imagegen-full", max_queued_requests=0, queue_timeout_s=0.2
        ) as engine:
            busy = engine.generate(_parsed(2000, seed=6), timeout_s=60)  # busy well past the 0.2 s waits
            await anext(busy)
            with pytest.raises(
                Overloaded,
                match="^imagegen-full denoising: 1 running and 0 waiting \\(imagegen.max_queued_requests\\)$",
            ):
                await _collect(engine, _parsed(2))
            engine.limiter.max_waiting = 4  # room to wait: the 0.2 s wait runs out instead
            with pytest.raises(Overloaded, match="no free batch slot within 0.2s"):
                await _collect(engine, _parsed(2))
            assert _cancelled() == 0  # refused requests never joined: nothing was cancelled
            await busy.aclose()
            assert _cancelled() == 1

    asyncio.run(run())


def test_a_failed_forward_fails_its_requests_only(pipeline, monkeypatch):
    real_step = pipeline.step
    calls = {"n": 0}

    def flaky(states):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fault")
        return real_step(states)

    async def run():
        async with _engine(pipeline) as engine:
            monkeypatch.setattr(pipeline, "step", flaky)
            with pytest.raises(RuntimeError, match="device fault"):
                await _collect(engine, _parsed(5, seed=7))
            monkeypatch.setattr(pipeline, "step", real_step)
            await _wait_until(lambda: engine.limiter.in_use == 0, "the slot")
            return await _collect(engine, _parsed(2, seed=8))

    assert isinstance(asyncio.run(run())[-1], ImageResult)


def test_a_dead_device_thread_fails_held_requests_instead_of_leaving_them_waiting(pipeline, monkeypatch):
    """An error outside one request's work ended the device thread (on a GPU: `torch.cuda.set_device`
    of a device without an index); the request it held waited forever. Now every held request fails
    with the cause, and later ones are refused."""
    from omnistage.services.imagegen.runner import ImageGenRunner

    def broken(self):
        raise RuntimeError("scheduling bug")

    failures: list[BaseException] = []

    async def run():
        async with _engine(pipeline, on_failure=failures.append) as engine:
            monkeypatch.setattr(ImageGenRunner, "_next_group", broken)
            with pytest.raises(RuntimeError, match="device thread failed: RuntimeError: scheduling bug"):
                await asyncio.wait_for(_collect(engine, _parsed(3, seed=5)), 30)
            with pytest.raises(Exception, match="stopped|failed"):
                await asyncio.wait_for(_collect(engine, _parsed(3, seed=6)), 30)

    asyncio.run(run())
    assert len(failures) == 1 and "scheduling bug" in str(failures[0]), "the service was not told it failed"


def _queue_time(service: str) -> tuple[float, float]:
    labels = {"service": service}
    return (
        REGISTRY.get_sample_value("omnistage_imagegen_queue_time_seconds_count", labels) or 0.0,
        REGISTRY.get_sample_value("omnistage_imagegen_queue_time_seconds_sum", labels) or 0.0,
    )


def test_queue_time_is_observed_once_per_request_with_its_wait_for_a_slot(pipeline):
    async def run():
        async with _engine(pipeline, cap=1, service="imagegen-queue") as engine:
            engine.export_metrics()
            before, started = _queue_time("imagegen-queue"), time.monotonic()
            first = engine.generate(_parsed(6, seed=1), timeout_s=60)
            await anext(first)  # in the loop, holding the only slot
            second = asyncio.create_task(_collect(engine, _parsed(2, seed=2)))
            await _wait_until(lambda: engine.limiter.waiting == 1, "the second request to wait for the slot")
            second_waiting_by = time.monotonic()
            assert (await anext(first)).step == 2  # the first still has steps to go ...
            assert engine.limiter.waiting == 1  # ... and the second still waits
            still_waiting_at = time.monotonic()
            [ev async for ev in first]
            await second
            return (
                before,
                _queue_time("imagegen-queue"),
                still_waiting_at - second_waiting_by,
                time.monotonic() - started,
            )

    before, after, waited_at_least, elapsed = asyncio.run(run())
    assert after[0] - before[0] == 2  # once per request, not per step
    assert waited_at_least <= after[1] - before[1] <= 2 * elapsed


def test_a_request_that_leaves_before_the_loop_leaves_no_queue_time(pipeline):
    async def run():
        async with _engine(pipeline, cap=1, service="imagegen-queue-left") as engine:
            engine.export_metrics()
            before = _queue_time("imagegen-queue-left")
            first = engine.generate(
                _parsed(2000, seed=1), timeout_s=60
            )  # holds the slot well past the cancel
            await anext(first)
            second = asyncio.create_task(_collect(engine, _parsed(2, seed=2)))
            await _wait_until(lambda: engine.limiter.waiting == 1, "the second request to wait for the slot")
            second.cancel()  # the client left while waiting for a slot
            with pytest.raises(asyncio.CancelledError):
                await second
            await _wait_until(lambda: engine.limiter.waiting == 0, "the waiting request to be gone")
            assert engine.limiter.in_use == 1  # the first still denoises: the second left on its own
            await first.aclose()
            await _wait_until(lambda: engine.load() == (0, 0), "the engine to be idle")
            return before, _queue_time("imagegen-queue-left")

    before, after = asyncio.run(run())
    assert after[0] - before[0] == 1  # the second never reached the device thread


def test_a_job_cancelled_before_the_device_thread_takes_it_is_not_reported(pipeline):
    from omnistage.common.runtime.device_loop import DeviceLoop
    from omnistage.services.imagegen.runner import ImageGenRunner, Job

    waits: list[float] = []
    released = threading.Event()
    runner = ImageGenRunner(pipeline, name="imagegen-inbox", on_admit=waits.append)
    loop = DeviceLoop("imagegen-inbox", runner)
    job = Job(_parsed(2).spec, lambda ev: None, released.set)
    job.cancel()
    loop.admit(lambda: runner.put(job))  # in the inbox before the thread runs
    loop.start()
    try:
        assert released.wait(30), "the cancelled job was never let go"
    finally:
        loop.stop()
    assert waits == [] and runner.dropped == 1
