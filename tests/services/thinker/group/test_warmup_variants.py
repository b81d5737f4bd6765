"""The warm-up compiles every kernel variant a prompt can select, so no request pays a first build.

The fused MoE picks its tiles, its shared-expert fold and its alignment layout by the step's routed
pairs, the router its path by the step's tokens; a prompt whose size lands in a band no warm-up shape
(nor a captured decode size) reached compiled a variant on the GPU at first use (one H200: a 128-token
prompt paid ~0.8 s for the MoE tiles that neither 64 nor 512 tokens pick)."""

from __future__ import annotations

import pytest
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.cuda_graphs import graph_batch_sizes
from omnistage.services.thinker.group.warmup import warmup_shapes
from omnistage.services.thinker.kernels.fused_moe import choose_tiles, folds_shared
from omnistage.services.thinker.kernels.moe_align import one_program
from omnistage.services.thinker.kernels.router import ROUTE_TABLE

# (experts, top_k, intermediate per rank, hidden): Ling-mini at TP=1, Ming-flash at TP=2.
SHAPES = {"ling-mini tp1": (256, 8, 512, 2048), "ming-flash tp2": (256, 8, 512, 4096)}


def variant(tokens: int, shape: tuple[int, int, int, int]) -> tuple:
    """What a step of `tokens` tokens compiles: MoE tiles, fold, alignment layout, router row."""
    experts, top_k, intermediate, hidden = shape
    pairs = tokens * top_k
    route = next((row for row in ROUTE_TABLE if tokens <= row[0]), "cublas")
    return (
        choose_tiles(pairs, experts, intermediate, hidden),
        folds_shared(pairs, True),
        one_program(pairs, True),
        route,
    )


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("batched,model_len", [(4096, 8192), (2048, 4096), (8192, 32768)])
def test_every_variant_a_prompt_can_meet_is_compiled_before_serving(name, batched, model_len):
    cfg = resolve_engine_config(
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=batched, max_model_len=model_len)
    )
    shape = SHAPES[name]
    warmed = {s.num_tokens for s in warmup_shapes(cfg)} | set(graph_batch_sizes(cfg.max_num_seqs))
    compiled = {variant(t, shape) for t in warmed}
    largest = min(cfg.max_num_batched_tokens, cfg.max_model_len - 1)
    missed = sorted(t for t in range(1, largest + 1) if variant(t, shape) not in compiled)
    assert not missed, f"{name}: prompts of {missed[:3]}..{missed[-3:]} tokens compile at first use"
