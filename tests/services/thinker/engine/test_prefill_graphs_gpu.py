"""On a GPU (skipped without CUDA), the tiny checkpoint: prefill and mixed steps replayed from captured
prefill graphs, text and media (image and audio rows), give the eager engine's greedy tokens in fp32
(= the CPU reference's kernels, the graphs off) and in bf16; a covered step is a replay, not an eager
forward."""

from __future__ import annotations

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.common.transport import TransportContext
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.multimodal import MediaInputs

from tests.services.thinker.engine.mm_prompts import items, layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# A pinned KV size (see test_async_scheduling_gpu.py); chunks of at most 64 tokens, graphs at 16-64.
CFG = dict(block_size=16, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, kv_tokens=4096)
PARTS = [
    [("text", 30)],
    [("text", 4), ("image", (3, 3)), ("text", 6)],
    [("text", 2), ("audio", 12), ("text", 5)],
    [("text", 70)],  # chunked: a 64-token chunk beside decodes, then its tail
]


def engine(ckpt, dtype: str, graphs: tuple[int, ...]) -> LLMEngine:
    cfg = RankConfig(
        str(ckpt), EngineConfig(**CFG, prefill_graph_tokens=graphs), dtype=dtype, device="cuda:0"
    )
    return rank0_engine(start_rank(cfg))


def prompts(ckpt):
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    inputs = MediaInputs(cfg, torch.float32, TransportContext())
    out = []
    for seed, parts in enumerate(PARTS):
        ids, media = layout(cfg, parts, seed=seed)
        out.append(inputs.build(ids, items(cfg, media)) if media else ids)
    inputs.close()
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_graphs_give_the_eager_tokens_on_the_gpu(tiny_ckpt, dtype):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [r.token_ids for r in engine(tiny_ckpt, dtype, ()).generate(prompts(tiny_ckpt), params)]
    e = engine(tiny_ckpt, dtype, (16, 32, 64))
    graphs = e.runner.prefill_graphs
    assert graphs is not None and graphs.ready and len(graphs.graphs) == 6  # text and media at 3 sizes
    assert [r.token_ids for r in e.generate(prompts(tiny_ckpt), params)] == want
    assert graphs.replays > 0
