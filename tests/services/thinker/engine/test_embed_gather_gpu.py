"""On a GPU (skipped without CUDA): the embedding lookup's one launch (kernels/embed_gather.py, with
PDL on Hopper) gives the torch path's rows exactly on every TP shard in bf16 and fp32; a captured
graph that writes the ids and the sampled ids and then looks them up gives, replayed with new
values, the torch rows of those values; and the engine's greedy tokens through decode graphs with
async scheduling (each step's ids the step before's placeholders) are the same with the switch on
and off. Here, not in kernels/, whose conftest runs Triton in its interpreter."""

from __future__ import annotations

import random

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.models.layers.backends import FUSED_EMBED_ENV
from omnistage.services.thinker.models.layers.embed_head import embed_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB, HIDDEN = 1000, 2048
CUDA = torch.device("cuda", 0)


def _ids(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain ids, ids past the vocabulary and placeholders (some past the sampled ids), and 8
    sampled ids (one past the vocabulary, one negative), on the device."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-12, VOCAB + 50, (tokens,), generator=g)
    ids[0] = -1
    sampled = torch.randint(0, VOCAB, (8,), generator=g)
    sampled[1], sampled[2] = VOCAB + 7, -3
    return ids.to(CUDA), sampled.to(CUDA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 17])
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_the_launch_gives_the_torch_rows_on_every_shard(dtype, tokens, tp):
    from omnistage.services.thinker.kernels import embed_gather

    rows = -(-VOCAB // tp)
    ids, sampled = _ids(tokens, seed=tokens + tp)
    for rank in range(tp):
        start, end = rank * rows, min(VOCAB, rank * rows + rows)
        weight = torch.randn(rows, HIDDEN, device=CUDA).to(dtype)
        for feed in (None, sampled):
            assert embed_gather.chooses_kernel(ids, weight, feed)
            got = embed_gather.rows(ids, weight, VOCAB, start, end, feed)
            assert torch.equal(got, embed_reference(ids, weight, VOCAB, start, end, feed)), (rank, feed)


def test_a_replayed_graph_looks_up_the_values_written_before_it():
    from omnistage.services.thinker.kernels import embed_gather

    weight = torch.randn(VOCAB, HIDDEN, device=CUDA).to(torch.bfloat16)
    ids, sampled = _ids(4, seed=0)
    staged_ids, staged_sampled = ids.clone(), sampled.clone()  # what the graph copies in each replay

    def forward() -> torch.Tensor:
        ids.copy_(staged_ids)  # kernels writing the operands right before the PDL launch
        sampled.copy_(staged_sampled)
        return embed_gather.rows(ids, weight, VOCAB, 0, VOCAB, sampled)

    stream = torch.cuda.Stream(CUDA)
    stream.wait_stream(torch.cuda.current_stream(CUDA))
    with torch.cuda.stream(stream):
        forward()  # compiled outside the capture
    torch.cuda.current_stream(CUDA).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = forward()
    for seed in range(1, 4):
        new_ids, new_sampled = _ids(4, seed=seed)
        staged_ids.copy_(new_ids)
        staged_sampled.copy_(new_sampled)
        graph.replay()
        want = embed_reference(new_ids, weight, VOCAB, 0, VOCAB, new_sampled)
        assert torch.equal(out, want), seed


# A pinned KV size: two engines live at once here, and an auto-sized one takes the whole card.
CFG = dict(block_size=16, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, kv_tokens=4096)


def test_the_engines_tokens_through_decode_graphs_are_the_same_with_the_switch_on_and_off(
    tiny_ckpt, monkeypatch
):
    rng = random.Random(7)
    prompts = [[rng.randrange(0, 900) for _ in range(rng.randrange(8, 100))] for _ in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    got = {}
    for value in ("off", "on"):
        monkeypatch.setenv(FUSED_EMBED_ENV, value)
        cfg = EngineConfig(**CFG, async_scheduling="on")
        engine = rank0_engine(start_rank(RankConfig(str(tiny_ckpt), cfg, dtype="bfloat16", device="cuda:0")))
        embedding = engine.runner.model.model.word_embeddings
        assert (embedding.kernel is not None) == (value == "on")
        replays = engine.runner.graphs.replays
        got[value] = [r.token_ids for r in engine.generate(prompts, params)]
        assert engine.runner.graphs.replays > replays
    assert got["on"] == got["off"]
