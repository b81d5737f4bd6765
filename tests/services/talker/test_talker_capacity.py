"""The talker's capacity at start-up: the step batch from the stress, the streams from what one
stream's caches cost within the memory budget (more than the step batch), checked by building the
serving runner and running its largest step — over the budget, fewer streams."""

from __future__ import annotations

import pytest
from omnistage.common.config import TalkerConfig
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.talker import startup
from omnistage.services.talker.startup import CacheSizes, stream_bytes, streams_that_fit

CFG = TalkerConfig(
    stress_batch_sizes=(2, 1),
    max_lm_tokens=256,
    max_segment_seconds=4,
    max_reference_seconds=2,
    max_transcript_chars=40,
    max_segment_length=10,
    max_streams=64,
)


def _serving(models, voices, budget: int, full: bool = True):
    mem = SimulatedDeviceMemory(1 << 36, segment_bytes=1 << 16)
    details: list[str] = []

    def report(phase: str, detail: str) -> None:
        details.append(detail)

    with mem.meter():
        prof = startup.profile(models, mem, CFG, budget, report, voices.speaker.dim, full)
        runner, _ = startup.build_runner(models, mem, CFG, prof, budget, report, voices.speaker.dim)
    return prof, runner, mem, details


@pytest.fixture(scope="module")
def unbounded(talker_models, voices):
    """The start-up without a memory budget (the profile and the serving runner it builds): the
    reference the budgeted start-ups below are sized from, built once for them."""
    prof, runner, _, _ = _serving(talker_models, voices, budget=0)
    return prof, runner


def test_the_stream_rule():
    assert streams_that_fit(8, peak=10_000, budget=0, per_stream=100, most=128) == 128  # no budget
    assert streams_that_fit(8, peak=10_000, budget=10_550, per_stream=100, most=128) == 13
    assert streams_that_fit(8, peak=10_000, budget=30_000, per_stream=100, most=128) == 128
    assert streams_that_fit(8, peak=12_000, budget=10_000, per_stream=100, most=128) == 8  # never below


def test_one_streams_bytes_are_its_slot_of_the_caches(talker_models):
    caches = CacheSizes.of(talker_models, CFG)
    from omnistage.services.talker.model_runner import TalkerRunner

    runner = TalkerRunner(talker_models, 5, caches.lm_tokens, caches.vae_frames)
    assert stream_bytes(talker_models, caches) * 6 == runner.cache_bytes  # five slots + the scratch


def test_streams_fill_the_budget_beyond_the_step_batch_and_the_serving_step_fits(
    talker_models, voices, unbounded
):
    unbounded, runner = unbounded
    assert unbounded.step_batch == 2 and unbounded.max_streams == runner.slots == CFG.max_streams
    assert runner.step_batch == 2
    peak = unbounded.stress.peak_reserved
    per = unbounded.stream_bytes
    budget = peak + int(6.5 * per)
    prof, runner, mem, details = _serving(talker_models, voices, budget)
    assert prof.step_batch == 2
    assert 2 < prof.max_streams <= 2 + 6 and runner.slots == prof.max_streams
    assert mem.peak_reserved() <= budget  # the serving runner's largest step, measured
    assert any(f"caches of {prof.max_streams} streams" in d for d in details)


def test_a_budget_only_the_step_batch_fits_is_the_step_batch(talker_models, voices, unbounded):
    unbounded, _ = unbounded
    prof, runner, mem, _ = _serving(talker_models, voices, unbounded.stress.peak_reserved + 1)
    assert prof.max_streams == prof.step_batch == runner.slots
    assert mem.peak_reserved() <= unbounded.stress.peak_reserved + 1


@pytest.mark.parametrize("budget_streams", [3])
def test_the_engine_reports_its_streams_and_step_batch(talker_models, voices, budget_streams):
    from omnistage.services.talker.model_runner import TalkerRunner
    from omnistage.services.talker.request_flow import TalkerEngine

    caches = CacheSizes.of(talker_models, CFG)
    engine = TalkerEngine(
        TalkerRunner(talker_models, 6, caches.lm_tokens, caches.vae_frames, step_batch=budget_streams)
    )
    assert engine.max_streams == 6 and engine.step_batch == 3 and engine.streams.limit == 6


def test_without_memory_to_prove_the_largest_step_runs_once_on_the_serving_runner(
    talker_models, voices, monkeypatch
):
    steps: list[tuple[int, int]] = []  # (the runner's slots, the step's batch)
    exercise = startup.exercise

    def recorded(runner, models, cfg, caches, batch, speaker_dim):
        steps.append((runner.slots, batch))
        exercise(runner, models, cfg, caches, batch, speaker_dim)

    monkeypatch.setattr(startup, "exercise", recorded)
    prof, runner, _, _ = _serving(talker_models, voices, budget=0, full=False)
    assert prof.stress.attempts == () and prof.step_batch == runner.step_batch == 2
    assert steps == [(CFG.max_streams, 2)] and runner.slots == CFG.max_streams  # no stress runner before it
