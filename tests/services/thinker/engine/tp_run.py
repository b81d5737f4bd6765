"""Run a scenario on rank 0 of a TP=2 group over gloo (rank 0 in a spawned process, its worker
spawned by it), and get its result back within a deadline."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from omnistage.common.config import EngineConfig, TPConfig
from omnistage.common.log import setup_logging
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank

from tests.services.thinker.group import local_ranks

TP = TPConfig(
    startup_collective_timeout_s=60, serving_collective_timeout_s=60, failure_exit_s=10, peer_timeout_s=5
)


def _rank0(
    scenario: Callable[[LLMEngine], Any], ckpt: str, engine_cfg: EngineConfig, port: int, out: mp.Queue
) -> None:
    setup_logging("thinker", rank=0)
    # The warm-up a service runs on a plain CPU (each path once, on both ranks or neither).
    cfg = RankConfig(ckpt, engine_cfg, tp=TP, world_size=2, dist_port=port, full_warmup=False)
    procs = local_ranks.spawn_workers(cfg)

    def run() -> tuple[Any, list[int]]:
        e = rank0_engine(start_rank(cfg))
        result = scenario(e)
        e.shutdown()
        return result, local_ranks.join_workers(procs, local_ranks.EXIT_WAIT_S)

    local_ranks.report_outcome(out, run)


def run_tp2(
    scenario: Callable[[LLMEngine], Any], ckpt, engine_cfg: EngineConfig, deadline_s: float = 120
) -> Any:
    """`scenario(engine)` on rank 0 of a TP=2 group (a module-level function: it is pickled); its
    result (picklable), after the worker exited with 0."""
    args = (scenario, str(ckpt), engine_cfg, local_ranks.free_port())
    status, result, detail = local_ranks.run_rank0(_rank0, args, deadline_s)
    assert status == "ok", f"{result}\n{detail}"
    assert detail == [0], f"worker exit codes {detail}"
    return result
