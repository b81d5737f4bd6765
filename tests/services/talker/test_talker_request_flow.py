"""TalkerEngine on the tiny checkpoint, stepped by hand: seeded jobs reproduce, batched jobs equal each
alone, a cancelled job frees its slot at once, a failing step fails only its jobs, the stop rules hold;
each segment's queue time is observed once, at its first step, and never for a segment cancelled before."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from omnistage.services.talker.metrics import queue_time_hook
from omnistage.services.talker.model_runner import TalkerRunner
from omnistage.services.talker.request_flow import JobDone, JobFailed, TalkerEngine
from prometheus_client import REGISTRY

from tests.services.talker.talker_jobs import job, run, run_staggered


@pytest.fixture
def engine(talker_models):
    return TalkerEngine(TalkerRunner(talker_models, 3, 256, 640))


def test_a_seeded_job_reproduces_and_another_seed_differs(talker_models, voices, engine):
    outs = []
    for seed in (1, 1, 2):
        j, rec = job(talker_models, voices, seed=seed)
        engine.submit(j)
        run(engine, rec)
        assert rec.done == JobDone(6, False)  # min_steps 100: only the step budget ends it
        outs.append(rec.audio)
    assert outs[0].shape == (6 * talker_models.config.samples_per_step,)
    np.testing.assert_array_equal(outs[0], outs[1])
    assert not np.allclose(outs[0], outs[2])


def test_batched_jobs_equal_each_alone(talker_models, voices, engine):
    specs = [
        dict(text="Hello there, my friend.", seed=3, max_steps=5),
        dict(text="一个完全不同的句子。", seed=4, max_steps=7, voice="lingguang"),
        dict(text="Short.", seed=5, max_steps=3),
    ]
    alone = []
    for spec in specs:
        j, rec = job(talker_models, voices, **spec)
        engine.submit(j)
        run(engine, rec)
        alone.append(rec.audio)
    recs = run_staggered(engine, talker_models, voices, specs)
    assert engine.loop.largest_batch == 3
    for rec, want in zip(recs, alone, strict=True):
        np.testing.assert_allclose(rec.audio, want, atol=2e-5, rtol=1e-3)


def test_a_cancelled_job_frees_its_slot_at_the_next_step(talker_models, voices, engine):
    j, rec = job(talker_models, voices, max_steps=50)
    engine.submit(j)
    engine.step()
    engine.step()
    assert engine.jobs_in_flight == 1 and engine.runner.scheduler.free_slots == 2
    engine.cancel(j)
    seen = len(rec.events)
    engine.step()
    assert engine.jobs_in_flight == 0 and engine.runner.scheduler.free_slots == 3
    assert j.history is None and j.stream is None and j.next_input is None
    assert len(rec.events) == seen  # nothing after the cancel
    queued, queued_rec = job(talker_models, voices)
    engine.submit(queued)
    engine.cancel(queued)  # cancelled before admission: never takes a slot
    engine.step()
    assert engine.jobs_in_flight == 0 and not queued_rec.events


def test_a_failing_step_fails_its_jobs_and_the_engine_goes_on(talker_models, voices, engine, monkeypatch):
    a, rec_a = job(talker_models, voices)
    engine.submit(a)
    real = engine.runner.model.sample

    def broken(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(engine.runner.model, "sample", broken)
    engine.step()
    assert (
        isinstance(rec_a.events[-1], JobFailed)
        and engine.jobs_in_flight == 0
        and engine.runner.scheduler.free_slots == 3
    )
    monkeypatch.setattr(engine.runner.model, "sample", real)
    b, rec_b = job(talker_models, voices)
    engine.submit(b)
    run(engine, rec_b)
    assert rec_b.done is not None


def test_the_stop_head_ends_a_segment_only_after_min_steps(talker_models, voices, engine, monkeypatch):
    real = engine.runner.model.sample

    def always_stop(*args, **kwargs):
        patch, nxt, stop = real(*args, **kwargs)
        return patch, nxt, torch.ones_like(stop)

    monkeypatch.setattr(engine.runner.model, "sample", always_stop)
    j, rec = job(talker_models, voices, max_steps=50, min_steps=4)
    engine.submit(j)
    run(engine, rec)
    assert rec.done == JobDone(6, True)  # steps 0..4 may not stop; step 5 (> 4) does, after 6 patches
    assert rec.audio.shape == (6 * talker_models.config.samples_per_step,)


def test_the_threaded_engine_serves_jobs_and_device_calls(talker_models, voices, engine):
    engine.start()
    try:
        assert engine.call(lambda: 41 + 1).result(timeout=30) == 42
        j, rec = job(talker_models, voices, max_steps=3)
        engine.submit(j)
        for _ in range(600):
            if rec.done:
                break
            engine.call(lambda: None).result(timeout=30)
        assert rec.done is not None
    finally:
        engine.stop()


def _queue_time(service: str) -> tuple[float, float]:
    labels = {"service": service}
    return (
        REGISTRY.get_sample_value("omnistage_talker_queue_time_seconds_count", labels) or 0.0,
        REGISTRY.get_sample_value("omnistage_talker_queue_time_seconds_sum", labels) or 0.0,
    )


def test_queue_time_is_observed_once_per_segment_with_its_wait_for_a_slot(talker_models, voices):
    engine = TalkerEngine(TalkerRunner(talker_models, 1, 256, 640), service="talker-queue")
    engine.on_admit = queue_time_hook("talker-queue")
    before, started = _queue_time("talker-queue"), time.monotonic()
    a, rec_a = job(talker_models, voices, max_steps=4)
    b, rec_b = job(talker_models, voices, max_steps=4)
    engine.submit(a)
    engine.submit(b)  # one slot: b waits until a is done
    b_queued_by = time.monotonic()
    run(engine, rec_a)
    a_done_at = time.monotonic()
    assert _queue_time("talker-queue")[0] - before[0] == 1  # a only: observed at its first step, not per step
    run(engine, rec_b)
    count, total = _queue_time("talker-queue")
    assert count - before[0] == 2
    assert a_done_at - b_queued_by <= total - before[1] <= 2 * (time.monotonic() - started)


def test_a_segment_cancelled_before_its_first_step_leaves_no_queue_time(talker_models, voices):
    engine = TalkerEngine(TalkerRunner(talker_models, 1, 256, 640), service="talker-queue-cancel")
    engine.on_admit = queue_time_hook("talker-queue-cancel")
    before = _queue_time("talker-queue-cancel")
    a, rec_a = job(talker_models, voices, max_steps=3)
    b, rec_b = job(talker_models, voices, max_steps=3)
    engine.submit(a)
    engine.submit(b)
    engine.step()  # a takes the only slot; b waits
    engine.cancel(b)
    run(engine, rec_a)
    engine.step()
    assert not rec_b.events and engine.jobs_in_flight == 0
    assert _queue_time("talker-queue-cancel")[0] - before[0] == 1


def test_prompts_prefilled_together_equal_each_prefilled_alone(talker_models):
    """Right-padded prompts of different lengths in one forward: each its own last hidden state and the same
    keys in its slot as alone; the padding went to the scratch slot."""
    hidden = talker_models.config.llm.hidden_size
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randn(n, hidden, generator=gen) for n in (7, 12, 3)]
    alone, together = TalkerRunner(talker_models, 3, 32, 64), TalkerRunner(talker_models, 3, 32, 64)
    want = torch.stack([alone.prefill(slot, x) for slot, x in enumerate(prompts)])
    got = together.prefill_batch([0, 1, 2], prompts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer in range(talker_models.config.llm.num_layers):
        torch.testing.assert_close(
            together.lm_cache.k[layer][:3], alone.lm_cache.k[layer][:3], atol=1e-6, rtol=1e-5
        )
