"""On a GPU (skipped without CUDA): the bf16 decode graphs' output is the LM head's bf16 logits (no
fp32 copy in the graph, issue 40), the sampler's greedy argmax reads that buffer as it is, each
step's ids are those of the logits' fp32 cast, and the captured engine gives the eager engine's
greedy tokens; the argmax launch on bf16 rows of Ling's vocabulary picks the fp32 cast's ids, ties
and NaNs included. Here, not in kernels/, whose conftest runs Triton in its interpreter."""

from __future__ import annotations

import random

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine import sampler as sampler_module
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# A pinned KV size: two engines live at once here, and an auto-sized one takes the whole card.
CFG = dict(block_size=16, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, kv_tokens=4096)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def engine(ckpt, **engine_cfg) -> LLMEngine:
    cfg = RankConfig(str(ckpt), EngineConfig(**CFG, **engine_cfg), dtype="bfloat16", device="cuda:0")
    return rank0_engine(start_rank(cfg))


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(0, 900) for _ in range(rng.randrange(8, 100))] for _ in range(n)]


def recorded_greedy(monkeypatch) -> list[tuple[int, torch.dtype, torch.Tensor, torch.Tensor]]:
    """Each greedy argmax: (the logits' address, their dtype, the ids, the ids of their fp32 cast),
    the copies queued right behind the launch (before the next replay rewrites the buffers)."""
    seen = []
    inner = sampler_module.greedy_ids

    def greedy_ids(logits, out=None):
        ids = inner(logits, out)
        seen.append((logits.data_ptr(), logits.dtype, ids.clone(), logits.float().argmax(dim=-1)))
        return ids

    monkeypatch.setattr(sampler_module, "greedy_ids", greedy_ids)
    return seen


@pytest.mark.parametrize("n", [1, 6], ids=["one-sequence", "batch"])
def test_captured_bf16_decode_reads_the_graphs_bf16_logits_and_gives_the_eager_ids(tiny_ckpt, monkeypatch, n):
    want = [r.token_ids for r in engine(tiny_ckpt, cuda_graphs=False).generate(prompts(n), GREEDY)]
    e = engine(tiny_ckpt, cuda_graphs=True)
    graphs = e.runner.graphs
    assert graphs is not None and graphs.outputs
    assert {out.dtype for out in graphs.outputs.values()} == {torch.bfloat16}  # no fp32 copy inside
    buffers = {out.data_ptr() for out in graphs.outputs.values()}
    seen = recorded_greedy(monkeypatch)
    replays = graphs.replays
    assert [r.token_ids for r in e.generate(prompts(n), GREEDY)] == want
    assert graphs.replays > replays
    torch.cuda.synchronize()
    replayed = [s for s in seen if s[0] in buffers]
    assert len(replayed) >= graphs.replays - replays  # every replayed step's argmax read its buffer
    assert {dtype for _, dtype, _, _ in seen} == {torch.bfloat16}
    for _, _, ids, cast_ids in seen:
        assert torch.equal(ids, cast_ids)


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_the_argmax_launch_on_bf16_rows_of_lings_vocabulary_picks_the_casts_ids(rows):
    from omnistage.services.thinker.kernels import argmax

    vocab = 157_184
    gen = torch.Generator(device="cuda").manual_seed(rows)
    padded = torch.randint(-40, 41, (rows, vocab + 64), generator=gen, device="cuda").bfloat16() / 8
    x = padded[:, :vocab]  # the LM head's view: the gather's padding columns cut
    x[0, [150_000, 70_000, 2_049]] = 6.0  # a tie at the max in three chunks: the lowest index
    if rows > 1:
        x[1, [90_000, 5]] = float("nan")
        x[-1] = -0.0
        x[-1, 80_000] = 0.0
    for _ in range(3):  # launch after launch on the same slots and tickets
        got = argmax.argmax(x)
        assert torch.equal(got, x.float().argmax(dim=-1))
    assert got[0] == 2_049 and (rows == 1 or (got[1] == 5 and got[-1] == 0))
