"""Async scheduling at TP=2 over gloo, the tiny checkpoint: the worker gets each step's sampled ids
from rank 0 by a collective after the step (`StepPlan.share_sampled`), not in the next plan; tokens,
ends and an abort while a step runs are those of the synchronous engine at TP=1."""

from __future__ import annotations

import functools
import random

import pytest
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank

from tests.services.thinker.engine.tp_run import run_tp2

CFG = dict(block_size=16, max_model_len=256, max_num_batched_tokens=64)
DEADLINE_S = 180


def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(0, 900) for _ in range(rng.randrange(3, 90))] for _ in range(5)]


def scenario(params: list[SamplingParams], e: LLMEngine) -> dict:
    """A request aborted while a step runs, then the others to their ends (run on rank 0)."""
    ps = prompts()
    e.add_prompt("aborted", ps[0], SamplingParams(max_tokens=40, ignore_eos=True))
    seen = []
    for _ in range(4):
        seen += [t for out in e.step() for t in out.token_ids]
    final = e.abort("aborted")
    while e.has_unfinished():
        assert not e.step(), "an output after the abort"
    results = e.generate(ps, params, timeout_s=DEADLINE_S)
    return {
        "aborted": (seen, final.usage.completion_tokens),
        "results": [(r.token_ids, r.finish_reason.value) for r in results],
        "free_blocks": e.scheduler.block_manager.num_free_blocks == e.cfg.num_kv_blocks,
    }


@pytest.mark.slow
def test_tp2_with_async_scheduling_equals_the_synchronous_tp1_engine(tiny_ckpt):
    # The TP=1 reference starts as tp_run's ranks do (a plain CPU's warm-up: serving is tested here).
    reference = rank0_engine(start_rank(RankConfig(str(tiny_ckpt), EngineConfig(**CFG), full_warmup=False)))
    free = reference.generate(prompts(), SamplingParams(max_tokens=12, ignore_eos=True))
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=12, stop_token_ids=(free[1].token_ids[3],)),  # a slot spent in vain
        SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.2),  # completes at once
        SamplingParams(max_tokens=7, ignore_eos=True),
    ]
    want = scenario(params, reference)
    got = run_tp2(
        functools.partial(scenario, params), tiny_ckpt, EngineConfig(**CFG, async_scheduling="on"), DEADLINE_S
    )
    assert got["results"] == want["results"]
    seen, completion = got["aborted"]
    assert seen == want["aborted"][0][: len(seen)] and completion == len(seen) < 40
    assert got["free_blocks"] and want["results"][1][1] == "stop"
