"""The tiny engine of this folder's engine tests: the fast backends, and decode steps through the
CUDA-graph buffers uncaptured (the staging and bucket padding a replay takes, run eagerly: Triton's
interpreter cannot capture)."""

from __future__ import annotations

from pathlib import Path

from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.cuda_graphs import DecodeGraphs
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank


def fast_engine(ckpt: Path, engine_cfg: dict, max_batch: int = 2) -> LLMEngine:
    """Rank 0's engine on `ckpt` with triton attention and experts, its decode steps of up to
    `max_batch` sequences through uncaptured DecodeGraphs."""
    fast = EngineConfig(attention_backend="triton", moe_backend="triton", **engine_cfg)
    engine = rank0_engine(start_rank(RankConfig(str(ckpt), fast, warmup=False)))
    runner = engine.runner
    runner.use_graphs(
        DecodeGraphs(runner.model, max_batch, runner.cfg.max_blocks_per_seq, runner.device, capture=False)
    )
    return engine
