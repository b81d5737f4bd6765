"""The encoder runner on the real engine: concurrent requests share a forward, never above the tested
cap; a full service answers RESOURCE_EXHAUSTED; a cancelled request holds its slot until the device
is done with it and leaves no lease behind."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
from omnistage.common.runtime.errors import Overloaded
from omnistage.common.transport import decode
from omnistage.services.encoder.items import MediaItem
from prometheus_client import REGISTRY

from tests.services.encoder.engine_helpers import SMALL, leases, run_engine
from tests.services.encoder.media_samples import image_bytes

IMAGE = MediaItem("image", data=image_bytes(96, 64))


class Gate:
    """Wraps a runner: the first forward blocks until `open()`."""

    def __init__(self, runner):
        self.runner = runner
        self.entered = threading.Event()
        self.released = threading.Event()
        self.first = True

    def __call__(self, items):
        if self.first:
            self.first = False
            self.entered.set()
            assert self.released.wait(30), "gate never opened"
        return self.runner(items)

    def open(self) -> None:
        self.released.set()


async def _until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _gated(engine, modality="vision") -> Gate:
    gate = Gate(engine.runner.forwards[modality])
    engine.runner.forwards[modality] = gate
    return gate


def _metric(name: str, modality: str) -> float:
    return REGISTRY.get_sample_value(name, {"service": "enc-test", "modality": modality}) or 0.0


def test_concurrent_requests_share_one_forward(tiny_encoders):
    async def body(engine):
        gate = _gated(engine)
        before = (
            _metric("omnistage_encoder_batches_total", "vision"),
            _metric("omnistage_encoder_batched_items_total", "vision"),
        )
        tasks = [asyncio.ensure_future(engine.encode([IMAGE]))]
        await _until(gate.entered.is_set, "the first forward")
        tasks += [asyncio.ensure_future(engine.encode([IMAGE])) for _ in range(3)]
        await _until(lambda: engine.runner.queued == 3, "three queued items")
        gate.open()
        outs = await asyncio.gather(*tasks)
        for (o,) in outs:
            decode(o.ref, transport=engine.transport)
        after = (
            _metric("omnistage_encoder_batches_total", "vision"),
            _metric("omnistage_encoder_batched_items_total", "vision"),
        )
        return engine.runner.batches["vision"], engine.runner.largest_batch["vision"], before, after

    batches, largest, before, after = run_engine(tiny_encoders, body)
    assert (batches, largest) == (2, 3)  # one alone (blocked), then the three that queued behind it
    assert after[0] - before[0] == 2 and after[1] - before[1] == 4


def test_batches_never_exceed_the_stress_tested_cap(tiny_encoders):
    async def body(engine):
        gate = _gated(engine)
        tasks = [asyncio.ensure_future(engine.encode([IMAGE]))]
        await _until(gate.entered.is_set, "the first forward")
        tasks += [asyncio.ensure_future(engine.encode([IMAGE])) for _ in range(4)]
        limiter = engine.limiters["vision"]
        await _until(lambda: engine.runner.queued == 1, "one queued item")
        await asyncio.sleep(0.2)
        held = (limiter.in_use, engine.runner.queued)  # 1 in the forward + 1 queued; 3 wait for a slot
        gate.open()
        await asyncio.gather(*tasks)
        return held, engine.runner.largest_batch["vision"], limiter.peak_in_use

    held, largest, peak = run_engine(tiny_encoders, body, caps={"vision": 2, "audio": 2})
    assert held == (2, 1)
    assert largest <= 2 and peak == 2


def test_a_full_service_answers_resource_exhausted(tiny_encoders):
    cfg = dataclasses.replace(SMALL, queue_timeout_s=0.3)

    async def body(engine):
        gate = _gated(engine)
        first = asyncio.ensure_future(engine.encode([IMAGE]))
        await _until(gate.entered.is_set, "the first forward")
        with pytest.raises(Overloaded, match="no free batch slot"):
            await engine.encode([IMAGE])
        gate.open()
        (out,) = await first
        decode(out.ref, transport=engine.transport)
        return leases(engine)

    assert run_engine(tiny_encoders, body, caps={"vision": 1, "audio": 1}, cfg=cfg) == (0, 0)


def test_a_cancelled_request_keeps_its_slot_until_its_forward_ends(tiny_encoders):
    async def body(engine):
        gate = _gated(engine)
        limiter = engine.limiters["vision"]
        first = asyncio.ensure_future(engine.encode([IMAGE]))
        await _until(gate.entered.is_set, "the first forward")
        first.cancel()
        second = asyncio.ensure_future(engine.encode([IMAGE]))
        await asyncio.sleep(0.3)
        during = (limiter.in_use, engine.runner.queued, second.done())
        gate.open()
        (out,) = await second
        decode(out.ref, transport=engine.transport)
        with pytest.raises(asyncio.CancelledError):
            await first
        return during, limiter.peak_in_use, leases(engine)

    during, peak, after = run_engine(tiny_encoders, body, caps={"vision": 1, "audio": 1})
    assert during == (1, 0, False)  # the cancelled item still holds the only slot
    assert peak == 1 and after == (0, 0)


def test_a_request_cancelled_during_the_hand_over_leaves_no_lease(tiny_encoders):
    async def body(engine):
        real, entered, release = engine._ref, threading.Event(), threading.Event()
        made = []

        def slow(t, host, cuda):
            entered.set()
            assert release.wait(30)
            made.append(real(t, host, cuda))
            return made[-1]

        engine._ref = slow
        task = asyncio.ensure_future(engine.encode([IMAGE, IMAGE]))
        await _until(entered.is_set, "the hand-over")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await _until(lambda: len(made) == 2, "both refs to be made")
        await _until(lambda: leases(engine) == (0, 0), "the refs to be revoked")
        return [r.WhichOneof("payload") for r in made]

    assert run_engine(tiny_encoders, body) == ["shm", "shm"]  # leased, then revoked unsent


def _queue_time() -> tuple[float, float]:
    """(count, sum) of the encoder's queue-time histogram of the test engine."""
    labels = {"service": "enc-test"}
    return (
        REGISTRY.get_sample_value("omnistage_encoder_queue_time_seconds_count", labels) or 0.0,
        REGISTRY.get_sample_value("omnistage_encoder_queue_time_seconds_sum", labels) or 0.0,
    )


def test_queue_time_is_observed_once_per_item_with_its_wait_behind_the_running_forward(tiny_encoders):
    async def body(engine):
        engine.export_queue_time()
        gate = _gated(engine)
        before, started = _queue_time(), time.monotonic()
        tasks = [asyncio.ensure_future(engine.encode([IMAGE]))]
        await _until(gate.entered.is_set, "the first forward")
        tasks += [asyncio.ensure_future(engine.encode([IMAGE, IMAGE]))]
        await _until(lambda: engine.runner.queued == 2, "two queued items")
        queued_at = time.monotonic()
        await asyncio.sleep(0.05)
        gate.open()
        opened_at = time.monotonic()
        await asyncio.gather(*tasks)
        return before, _queue_time(), opened_at - queued_at, time.monotonic() - started

    before, after, held, elapsed = run_engine(tiny_encoders, body)
    assert after[0] - before[0] == 3  # one observation per item, none per forward or per row
    waited = after[1] - before[1]
    assert 2 * held <= waited <= 3 * elapsed  # the two queued items waited at least while the gate was shut


def test_an_item_cancelled_in_the_queue_leaves_no_queue_time(tiny_encoders):
    async def body(engine):
        engine.export_queue_time()
        gate = _gated(engine)
        before = _queue_time()
        first = asyncio.ensure_future(engine.encode([IMAGE]))
        await _until(gate.entered.is_set, "the first forward")
        second = asyncio.ensure_future(engine.encode([IMAGE]))
        await _until(lambda: engine.runner.queued == 1, "one queued item")
        (entry,) = engine.runner._queues["vision"]
        second.cancel()
        await _until(lambda: entry.cancelled, "the cancellation to reach the queued item")
        gate.open()
        await first
        with pytest.raises(asyncio.CancelledError):
            await second
        return before, _queue_time()

    before, after = run_engine(tiny_encoders, body)
    assert after[0] - before[0] == 1  # only the item whose forward ran
