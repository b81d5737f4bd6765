"""Audio clips share a forward by padded mel frames, not by a count of clips: the runner takes the
oldest clips while clips × the longest stays within the budget the stress proved (its cap × the
longest clip's frames), clips queue by frames, every clip gets its alone rows, and
`audio_batch_frames` lowers the budget without refusing a clip."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque

import numpy as np
import pytest
import torch
from omnistage.common.runtime.errors import Overloaded
from omnistage.common.transport import decode
from omnistage.services.encoder.items import ItemLimits, MediaItem
from omnistage.services.encoder.request_flow import batch_budgets
from omnistage.services.encoder.runner import Entry, take_batch
from prometheus_client import REGISTRY

from tests.services.encoder.engine_helpers import SMALL, leases, run_engine
from tests.services.encoder.test_encoder_runner import _gated, _until


def clip(seconds: float, seed: int) -> MediaItem:
    """`seconds` of 16 kHz noise: 100 mel frames a second."""
    samples = np.random.default_rng(seed).uniform(-0.3, 0.3, int(seconds * 16000)).astype(np.float32)
    return MediaItem("audio", samples=samples, sample_rate_hz=16000)


def _entries(*units: int) -> deque[Entry]:
    return deque(Entry(i, None, 0.0, u) for i, u in enumerate(units))  # type: ignore[arg-type]


def _forwards(queue: deque[Entry], budget: int) -> list[list[int]]:
    out = []
    while queue:
        out.append([e.units for e in take_batch(queue, budget)])
    return out


def test_a_forward_takes_the_oldest_clips_while_clips_times_the_longest_fit():
    assert _forwards(_entries(*[30] * 16), 600) == [[30] * 16]  # 16 short clips: one forward
    assert _forwards(_entries(*[30] * 16, 300), 600) == [[30] * 16, [300]]  # 17 × 300 would not fit
    assert _forwards(_entries(300, 30, 30), 600) == [[300, 30], [30]]  # padded to the longest
    assert _forwards(_entries(40, 30, 50), 120) == [[40, 30], [50]]  # first come, first served
    assert _forwards(_entries(700, 10), 600) == [[700], [10]]  # one over the budget runs alone


def test_the_audio_budget_is_the_stress_cap_times_the_longest_clip_lowered_by_the_knob(tiny_encoders):
    limits = ItemLimits.of(SMALL, tiny_encoders.config)
    assert limits.max_audio_frames == 300  # 3 s
    assert batch_budgets({"vision": 4, "audio": 2}, limits) == {"vision": 4, "audio": 600}
    lowered = ItemLimits.of(dataclasses.replace(SMALL, audio_batch_frames=450), tiny_encoders.config)
    assert batch_budgets({"vision": 4, "audio": 2}, lowered)["audio"] == 450
    below = ItemLimits.of(dataclasses.replace(SMALL, audio_batch_frames=50), tiny_encoders.config)
    assert batch_budgets({"vision": 4, "audio": 2}, below)["audio"] == 50  # longer clips run alone
    above = ItemLimits.of(dataclasses.replace(SMALL, audio_batch_frames=9000), tiny_encoders.config)
    assert batch_budgets({"vision": 4, "audio": 2}, above)["audio"] == 600  # never past what was proven


def _forward_count() -> float:
    labels = {"service": "enc-test", "modality": "audio"}
    return REGISTRY.get_sample_value("omnistage_encoder_forward_seconds_count", labels) or 0.0


def test_sixteen_short_clips_behind_a_forward_share_the_next_one_with_their_alone_rows(tiny_encoders):
    clips = [clip(0.2 + 0.01 * i, seed=i) for i in range(16)]  # 20 to 35 frames: 560 padded

    async def body(engine):
        (alone,) = await engine.encode([clips[5]])
        alone_rows = decode(alone.ref, transport=engine.transport).clone()
        before = (engine.runner.batches["audio"], _forward_count())
        gate = _gated(engine, "audio")
        first = asyncio.ensure_future(engine.encode([clip(0.5, seed=99)]))
        await _until(gate.entered.is_set, "the first forward")
        rest = [asyncio.ensure_future(engine.encode([c])) for c in clips]
        await _until(lambda: engine.runner.queued == 16, "sixteen queued clips")
        gate.open()
        outs = [o for (o,) in await asyncio.gather(first, *rest)]
        rows = [decode(o.ref, transport=engine.transport) for o in outs]
        after = (engine.runner.batches["audio"], _forward_count())
        return alone_rows, rows[6], before, after, engine.runner.largest_batch["audio"], leases(engine)

    alone, batched, before, after, largest, held = run_engine(
        tiny_encoders, body, caps={"vision": 2, "audio": 2}
    )
    assert (after[0] - before[0], largest) == (2, 16)  # the gated one, then all sixteen (cap 2: eight)
    assert after[1] - before[1] == 2  # the forward time is observed once per forward
    assert batched.shape == alone.shape and torch.allclose(batched, alone, atol=2e-6)
    assert held == (0, 0)


def test_clips_queue_by_frames_and_a_full_budget_answers_resource_exhausted(tiny_encoders):
    cfg = dataclasses.replace(SMALL, queue_timeout_s=0.3)

    async def body(engine):
        gate = _gated(engine, "audio")
        first = asyncio.ensure_future(engine.encode([clip(2.0, seed=1)]))  # 200 of 300 frames
        await _until(gate.entered.is_set, "the first forward")
        with pytest.raises(Overloaded, match=r"no free batch slot .*\(200/300 mel frames busy"):
            await engine.encode([clip(1.5, seed=2)])  # 150 more frames do not fit
        small = asyncio.ensure_future(engine.encode([clip(0.9, seed=3)]))  # 90 do: admitted, queued
        await _until(lambda: engine.runner.queued == 1, "the small clip queued")
        in_use = engine.limiters["audio"].in_use
        gate.open()
        for (out,) in await asyncio.gather(first, small):
            decode(out.ref, transport=engine.transport)
        return in_use, engine.limiters["audio"].in_use, leases(engine)

    assert run_engine(tiny_encoders, body, caps={"vision": 1, "audio": 1}, cfg=cfg) == (290, 0, (0, 0))


def test_a_lowered_budget_keeps_every_forward_within_it_and_runs_a_longer_clip_alone(tiny_encoders):
    cfg = dataclasses.replace(SMALL, audio_batch_frames=200)  # the stress proved 4 × 300 frames
    clips = [clip(1.0, seed=1), clip(1.0, seed=2), clip(2.5, seed=3), clip(1.0, seed=4)]

    async def body(engine):
        gate = _gated(engine, "audio")
        forward = engine.runner.forwards["audio"]
        seen: list[list[int]] = []
        engine.runner.forwards["audio"] = lambda items: (
            seen.append([x.batch_units for x in items]) or forward(items)
        )
        first = asyncio.ensure_future(engine.encode([clip(0.5, seed=8)]))
        await _until(gate.entered.is_set, "the first forward")
        limiter, rest = engine.limiters["audio"], []
        for n, c in enumerate(clips, 1):  # one after another: the order they reach the limiter
            rest.append(asyncio.ensure_future(engine.encode([c])))
            await _until(lambda n=n: engine.runner.queued + limiter.waiting == n, f"clip {n} at the limiter")
        waiting, held = limiter.waiting, limiter.in_use
        gate.open()
        for (out,) in await asyncio.gather(first, *rest):
            decode(out.ref, transport=engine.transport)
        return waiting, held, seen

    waiting, held, seen = run_engine(tiny_encoders, body, caps={"vision": 4, "audio": 4}, cfg=cfg)
    assert (waiting, held) == (3, 150)  # the gated 50 frames and one 1 s clip; the rest wait (250 > 200)
    assert sorted(u for forward in seen for u in forward) == [50, 100, 100, 100, 250]
    assert [250] in seen  # longer than the budget: alone, not refused
    assert all(len(forward) * max(forward) <= 200 for forward in seen if forward != [250])
