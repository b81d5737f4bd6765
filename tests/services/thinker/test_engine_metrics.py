"""The thinker engine's metrics count what the engine did: tokens, requests, preemptions, latencies."""

from __future__ import annotations

import random

import pytest
from omnistage.common import metrics
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.engine_metrics import EngineMetrics
from prometheus_client import REGISTRY, Histogram

from tests.services.thinker.engine.engine_fakes import make_fake_engine


def _value(name: str, service: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"service": service, **labels}) or 0.0


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(32, 128) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_tokens_requests_and_latencies_are_counted_once_each(async_scheduling):
    engine = make_fake_engine(
        block_size=8,
        max_model_len=256,
        max_num_batched_tokens=64,
        num_kv_blocks=24,
        async_scheduling=async_scheduling,
    )
    svc = f"thinker-m1-{async_scheduling}"
    engine.stats = EngineMetrics(svc, engine)
    prompts = _prompts(12)
    engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert _value("omnistage_thinker_prompt_tokens_total", svc) == sum(len(p) for p in prompts)
    assert _value("omnistage_thinker_generated_tokens_total", svc) == 12 * 10
    assert _value("omnistage_thinker_requests_total", svc, finish_reason="length") == 12
    assert _value("omnistage_thinker_queue_time_seconds_count", svc) == 12
    assert _value("omnistage_thinker_ttft_seconds_count", svc) == 12
    assert _value("omnistage_thinker_inter_token_latency_seconds_count", svc) == 12 * 9
    assert _value("omnistage_thinker_e2e_seconds_count", svc) == 12
    assert _value("omnistage_thinker_preemptions_total", svc) > 0  # 24 blocks of 8 for 12 requests
    assert _value("omnistage_thinker_kv_blocks_capacity", svc) == 24
    assert _value("omnistage_thinker_kv_blocks_used", svc) == 0  # all freed again
    assert _value("omnistage_thinker_running_requests", svc) == 0
    assert _value("omnistage_thinker_waiting_requests", svc) == 0


def test_a_slot_spent_for_a_request_that_stopped_meanwhile_is_not_counted():
    """With async scheduling a request that stops by a stop id still has a slot in the step launched
    meanwhile: its token goes to nobody and counts for nothing."""
    free = make_fake_engine(block_size=8, max_model_len=256)
    outs = free.generate(_prompts(4), SamplingParams(max_tokens=12, ignore_eos=True))
    params = [SamplingParams(max_tokens=12, stop_token_ids=(r.token_ids[3],)) for r in outs]
    engine = make_fake_engine(block_size=8, max_model_len=256, async_scheduling="on")
    svc = "thinker-m5"
    engine.stats = EngineMetrics(svc, engine)
    results = engine.generate(_prompts(4), params)
    assert all(r.finish_reason.value == "stop" for r in results)
    assert _value("omnistage_thinker_generated_tokens_total", svc) == sum(len(r.token_ids) for r in results)
    assert _value("omnistage_thinker_requests_total", svc, finish_reason="stop") == 4
    assert _value("omnistage_thinker_e2e_seconds_count", svc) == 4


def test_state_gauges_read_the_engine_and_an_abort_ends_the_request():
    engine = make_fake_engine(block_size=8, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=2)
    engine.stats = EngineMetrics("thinker-m2", engine)
    svc = "thinker-m2"
    for i, p in enumerate(_prompts(3)):
        engine.add_prompt(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    assert _value("omnistage_thinker_waiting_requests", svc) == 3
    engine.step()
    assert _value("omnistage_thinker_running_requests", svc) == 2
    assert _value("omnistage_thinker_waiting_requests", svc) == 1
    assert _value("omnistage_thinker_kv_blocks_used", svc) > 0
    engine.abort("r2")  # never admitted: it ends without a token
    assert _value("omnistage_thinker_requests_total", svc, finish_reason="abort") == 1
    assert _value("omnistage_thinker_e2e_seconds_count", svc) == 1
    assert _value("omnistage_thinker_queue_time_seconds_count", svc) == 2


def test_prefix_cache_queries_hits_and_evictions_are_counted_in_tokens_and_blocks():
    engine = make_fake_engine(block_size=8, max_model_len=256, max_num_batched_tokens=256, num_kv_blocks=12)
    engine.stats = EngineMetrics("thinker-m3", engine)
    svc = "thinker-m3"
    prompt = [32 + i % 60 for i in range(40)]  # 40 tokens + 3 computed outputs: 5 full blocks
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.generate([prompt], greedy)
    assert _value("omnistage_thinker_prefix_cache_queries_total", svc) == len(prompt)
    assert _value("omnistage_thinker_prefix_cache_hits_total", svc) == 0
    assert _value("omnistage_thinker_prefix_cache_blocks", svc) == 5
    engine.generate([prompt], greedy)
    assert _value("omnistage_thinker_prefix_cache_queries_total", svc) == 2 * len(prompt)
    assert _value("omnistage_thinker_prefix_cache_hits_total", svc) == 32
    assert _value("omnistage_thinker_prefix_cache_evictions_total", svc) == 0
    engine.generate([[200 + i % 50 for i in range(92)]], greedy)  # 12 blocks: every cached one goes
    assert _value("omnistage_thinker_prefix_cache_evictions_total", svc) == 5


def test_observe_many_equals_repeated_observe():
    one = Histogram("omnistage_test_observe_one_seconds", "t", buckets=metrics.FINE_BUCKETS_S, registry=None)
    many = Histogram(
        "omnistage_test_observe_many_seconds", "t", buckets=metrics.FINE_BUCKETS_S, registry=None
    )
    for value, count in [(0.003, 5), (0.2, 1), (42.0, 3), (0.0, 2)]:
        for _ in range(count):
            one.observe(value)
        metrics.observe_many(many, value, count)
    samples = [
        [
            (s.name.replace("one", "x"), s.labels, s.value)
            for s in m.collect()[0].samples
            if not s.name.endswith("_created")
        ]
        for m in (one, many)
    ]
    assert samples[0] == [(n.replace("many", "x"), lab, v) for n, lab, v in samples[1]]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_every_step_reports_its_phases_by_kind(async_scheduling):
    """With async scheduling a step's phases are those of the call that completes it: its own wait
    and outputs, and the launch of the step after it when there is one (the last decode's call
    launches nothing). Each step is counted once."""
    engine = make_fake_engine(
        block_size=8, max_model_len=256, max_num_batched_tokens=256, async_scheduling=async_scheduling
    )
    svc = f"thinker-m4-{async_scheduling}"
    engine.stats = EngineMetrics(svc, engine)
    engine.generate(_prompts(3), SamplingParams(max_tokens=5, ignore_eos=True))
    phases = ("schedule", "plan", "launch", "sample", "wait", "output")
    assert set(engine.step_times.seconds) <= set(phases)
    for phase in phases:
        prefill = _value("omnistage_thinker_step_phase_seconds_count", svc, phase=phase, step="prefill")
        decode = _value("omnistage_thinker_step_phase_seconds_count", svc, phase=phase, step="decode")
        launches = async_scheduling == "on" and phase in ("plan", "launch", "sample")
        # The three prompts in one step, then four decode steps.
        assert (prefill, decode) == ((1, 3) if launches else (1, 4)), phase
