"""On a GPU (skipped without CUDA), the tiny checkpoint with decode graphs: async scheduling gives the
synchronous engine's greedy tokens in fp32 and bf16, and once the prompts are in, a decode step's
host path never waits for the device by a blocking copy or a host read of a device value
(`torch.cuda.set_sync_debug_mode("error")` around the steps: only the sampled ids' event is waited
for, behind the next step's launch)."""

from __future__ import annotations

import random

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# A pinned KV size: an auto-sized engine takes the whole card and this process's allocator keeps it,
# so a GPU test after this module in the same run (the CUDA IPC consumer) found no memory for its context.
CFG = dict(block_size=16, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, kv_tokens=4096)


def engine(ckpt, dtype: str, mode: str) -> LLMEngine:
    cfg = RankConfig(str(ckpt), EngineConfig(**CFG, async_scheduling=mode), dtype=dtype, device="cuda:0")
    return rank0_engine(start_rank(cfg))


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(0, 900) for _ in range(rng.randrange(8, 100))] for _ in range(n)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_scheduling_gives_the_synchronous_tokens_on_the_gpu(tiny_ckpt, dtype):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [r.token_ids for r in engine(tiny_ckpt, dtype, "off").generate(prompts(6), params)]
    e = engine(tiny_ckpt, dtype, "on")
    assert e.async_scheduling and e.runner.graphs is not None
    assert [r.token_ids for r in e.generate(prompts(6), params)] == want


def test_a_decode_step_never_waits_for_the_device_on_the_host(tiny_ckpt):
    e = engine(tiny_ckpt, "bfloat16", "auto")
    assert e.async_scheduling  # auto: on for CUDA
    for i, p in enumerate(prompts(4)):
        e.add_prompt(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):  # the prompts, then the decodes run ahead
        e.step()
    assert e.in_flight is not None and not e.scheduler.waiting
    replays = e.runner.graphs.replays
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            e.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert e.runner.graphs.replays - replays == 20  # every one a replayed decode graph
    while e.has_unfinished():
        e.step()
    assert e.scheduler.block_manager.num_free_blocks == e.cfg.num_kv_blocks


@pytest.mark.parametrize("n", [1, 2])
def test_one_or_two_sequences_stage_in_two_buffers_in_turn_and_keep_the_eager_tokens(tiny_ckpt, n):
    """At one or two sequences each decode step's inputs are copied into the staging buffer the step
    before did not read, on a copy stream, while that step runs (engine/decode_staging.py): a graph per
    buffer, both replayed, and the tokens those of the eager engine (no graphs) in fp32."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eager_cfg = RankConfig(
        str(tiny_ckpt), EngineConfig(**CFG, cuda_graphs=False), dtype="float32", device="cuda:0"
    )
    want = [r.token_ids for r in rank0_engine(start_rank(eager_cfg)).generate(prompts(n), params)]
    e = engine(tiny_ckpt, "float32", "on")
    graphs = e.runner.graphs
    assert {(n, 0), (n, 1)} <= set(graphs.graphs) and graphs.staging.copy_stream is not None
    used = []
    real_run = graphs.run

    def run(plan, fill=None):
        logits = real_run(plan, fill)
        used.append(graphs.buffer)
        return logits

    graphs.run = run
    assert [r.token_ids for r in e.generate(prompts(n), params)] == want
    assert len(used) >= 20 and all(a != b for a, b in zip(used, used[1:], strict=False)), used
