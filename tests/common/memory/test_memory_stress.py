"""Stress-and-cap: a synthetic stage doing real torch work under SimulatedDeviceMemory."""

from __future__ import annotations

import asyncio
import gc
import logging
from types import SimpleNamespace

import pytest
import torch
from omnistage.common.memory import stress
from omnistage.common.memory.device import MiB, SimulatedDeviceMemory
from omnistage.common.memory.report import export_memory
from omnistage.common.memory.stress import StressAndCap, StressError
from omnistage.common.runtime.concurrency import ConcurrencyLimiter
from prometheus_client import REGISTRY

CANDIDATES = [1, 2, 4, 8]  # configured max batch 8


class SyntheticEncoder:
    """A two-layer MLP over [batch, tokens, hidden] float32 inputs: activations scale with batch."""

    def __init__(self, hidden: int = 256, tokens: int = 512) -> None:
        self.tokens = tokens
        self.w1 = torch.randn(hidden, 4 * hidden).div_(hidden**0.5)
        self.w2 = torch.randn(4 * hidden, hidden).div_(hidden**0.5)
        self.hidden = hidden

    def __call__(self, batch: int) -> torch.Tensor:
        x = torch.randn(batch, self.tokens, self.hidden)
        h = (x @ self.w1).relu_()
        return (h @ self.w2).mean(dim=1)

    def activation_bytes(self, batch: int) -> int:
        """x + h + out of the second matmul, all alive together at the peak (float32)."""
        return 4 * batch * self.tokens * (self.hidden + 4 * self.hidden + self.hidden)


def _stage_on(capacity: int) -> tuple[SimulatedDeviceMemory, SyntheticEncoder]:
    mem = SimulatedDeviceMemory(capacity)
    with mem.meter():
        enc = SyntheticEncoder()  # weights: 2 x 1 MiB
    return mem, enc


def test_a_stage_that_fits_its_configured_max_gets_that_cap_not_one():
    mem, enc = _stage_on(256 * MiB)
    result = StressAndCap("encoder", mem, enc, CANDIDATES).run()
    assert result.max_batch == 8 and result.configured_max == 8
    assert [a.batch for a in result.attempts] == [8]  # largest first; nothing smaller needed
    assert result.peak_reserved >= 2 * MiB + enc.activation_bytes(8)
    # The peak stays reserved (no empty_cache): later services on this GPU see it as used.
    assert mem.reserved() == result.peak_reserved == result.reserved_after
    assert mem.allocated() == 2 * MiB  # activations are back in the cache, only weights live
    assert mem.free() == 256 * MiB - result.peak_reserved


def test_a_stage_that_fits_only_4_gets_4_and_logs_why(caplog):
    mem, enc = _stage_on(2 * MiB + enc_bytes(6))  # room for batch 6's activations, not 8
    with caplog.at_level(logging.INFO, logger="omnistage.common.memory.stress"):
        result = StressAndCap("encoder", mem, enc, CANDIDATES).run()
    assert result.max_batch == 4
    assert [(a.batch, a.fits) for a in result.attempts] == [(8, False), (4, True)]
    assert "out of memory" in result.attempts[0].reason
    assert (
        "concurrency capped at 4 of configured 8" in caplog.text and "batch 8: out of memory" in caplog.text
    )
    assert mem.reserved() == result.peak_reserved  # batch 4's peak kept, batch 8's growth given back


def test_an_attempt_collects_garbage_only_when_a_reference_cycle_still_holds_its_tensors(monkeypatch):
    """A full collection costs a second or more in a process with a model loaded: an attempt whose
    tensors all went with their references needs none; one whose tensors a cycle holds gets one."""
    mem, enc = _stage_on(256 * MiB)
    collections: list[int] = []
    monkeypatch.setattr(stress, "gc", SimpleNamespace(collect=lambda: collections.append(gc.collect())))

    def leaky(batch: int) -> None:
        node = {"out": enc(batch)}
        node["self"] = node  # the output is held by a reference cycle only

    gc.disable()  # no automatic collection may free the cycle first
    try:
        assert StressAndCap("encoder", mem, enc, [2]).run().max_batch == 2
        assert collections == [] and mem.allocated() == 2 * MiB
        assert StressAndCap("encoder", mem, leaky, [2]).run().max_batch == 2
        assert len(collections) == 1 and mem.allocated() == 2 * MiB
    finally:
        gc.enable()


def enc_bytes(batch: int) -> int:
    return SyntheticEncoder().activation_bytes(batch)


def test_a_budget_below_the_device_caps_too():
    mem, enc = _stage_on(1024 * MiB)
    budget = 2 * MiB + enc_bytes(3)
    result = StressAndCap("encoder", mem, enc, CANDIDATES, budget_bytes=budget).run()
    assert result.max_batch == 2
    assert [a.fits for a in result.attempts] == [False, False, True]
    assert all("budget" in a.reason for a in result.attempts[:2])
    assert result.peak_reserved <= budget


def test_nothing_fits_raises_naming_every_attempt_and_the_knobs():
    mem, enc = _stage_on(4 * MiB)  # weights 2 MiB; batch 1 needs 3 MiB more
    with pytest.raises(StressError) as exc:
        StressAndCap("talker", mem, enc, CANDIDATES).run()
    msg = str(exc.value)
    assert "talker: no batch size fits" in msg
    for b in CANDIDATES:
        assert f"batch {b}: out of memory" in msg
    assert "budget_bytes" in msg
    gc.collect()
    assert mem.allocated() == 2 * MiB  # failed attempts left nothing behind


def test_memory_report_and_metrics_show_the_kept_peak():
    mem, enc = _stage_on(256 * MiB)
    result = StressAndCap("encoder", mem, enc, [2, 1], budget_bytes=128 * MiB).run()
    report = result.memory_report(weights_bytes=2 * MiB)
    assert report.device == "sim" and report.budget_bytes == 128 * MiB
    assert result.baseline_reserved == 2 * MiB
    assert report.activation_peak_bytes == result.peak_reserved - 2 * MiB >= enc.activation_bytes(2)
    assert report.total_bytes == mem.reserved()
    export_memory("enc-test", 0, report)
    labels = {"service": "enc-test", "rank": "0", "device": "sim"}
    assert REGISTRY.get_sample_value("omnistage_memory_bytes", {**labels, "kind": "total"}) == mem.reserved()
    assert REGISTRY.get_sample_value("omnistage_memory_bytes", {**labels, "kind": "weights"}) == 2 * MiB
    assert REGISTRY.get_sample_value("omnistage_memory_budget_bytes", labels) == 128 * MiB


def test_limiter_caps_concurrency_at_the_tested_batch_and_times_out_with_a_message():
    mem, enc = _stage_on(2 * MiB + enc_bytes(6))
    result = StressAndCap("encoder", mem, enc, CANDIDATES).run()
    limiter = ConcurrencyLimiter(result.stage, result.max_batch)
    assert limiter.limit == 4

    async def main() -> None:
        release = asyncio.Event()

        async def request() -> None:
            async with limiter.slot(timeout_s=10):
                await release.wait()

        tasks = [asyncio.create_task(request()) for _ in range(6)]
        for _ in range(20):
            await asyncio.sleep(0)
        assert limiter.in_use == 4  # two wait for a slot
        with pytest.raises(TimeoutError, match="encoder: no free batch slot within 0.01s \\(4/4 busy"):
            async with limiter.slot(timeout_s=0.01):
                pass
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)

    asyncio.run(main())
    assert limiter.peak_in_use == 4 and limiter.in_use == 0


def test_bad_candidates_are_refused():
    mem = SimulatedDeviceMemory(MiB)
    with pytest.raises(ValueError, match="batch sizes >= 1"):
        StressAndCap("x", mem, lambda b: None, [])
    with pytest.raises(ValueError, match="batch sizes >= 1"):
        StressAndCap("x", mem, lambda b: None, [0, 2])


def test_without_memory_to_prove_one_smallest_attempt_proves_the_path_and_the_largest_is_the_cap(caplog):
    mem, enc = _stage_on(256 * MiB)
    ran: list[int] = []

    def run(batch: int) -> torch.Tensor:
        ran.append(batch)
        return enc(batch)

    with caplog.at_level(logging.INFO, logger="omnistage.common.memory.stress"):
        result = StressAndCap("encoder", mem, run, CANDIDATES).prove()
    assert ran == [1] and [(a.batch, a.fits) for a in result.attempts] == [(1, True)]
    assert result.max_batch == result.configured_max == 8
    assert result.peak_reserved >= 2 * MiB + enc.activation_bytes(1) and result.activation_peak_bytes > 0
    assert "batch 8 taken on sim without a memory run" in caplog.text


def test_a_path_proof_that_runs_out_of_memory_still_fails_the_start():
    mem, enc = _stage_on(4 * MiB)  # batch 1 needs 3 MiB more than the 2 MiB left
    with pytest.raises(StressError, match="batch 1: out of memory"):
        StressAndCap("encoder", mem, enc, CANDIDATES).prove()


def test_taking_the_largest_runs_nothing():
    mem = SimulatedDeviceMemory(MiB)
    result = StressAndCap("talker", mem, lambda b: pytest.fail("ran"), [2, 1]).take_largest()
    assert result.max_batch == 2 and result.attempts == () and result.activation_peak_bytes == 0
