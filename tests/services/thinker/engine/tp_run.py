"""Run a scenario on rank 0 of a TP=2 group over gloo (rank 0 in a spawned process, its worker
spawned by it), and get its result back within a deadline."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from typing import Any

import pytest
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
    cfg = RankConfig(ckpt, engine_cfg, tp=TP, world_size=2, dist_port=port)
    procs = local_ranks.spawn_workers(cfg)
    try:
        e = rank0_engine(start_rank(cfg))
        result = scenario(e)
        e.shutdown()
        out.put(("ok", result, local_ranks.join_workers(procs, 30)))
    except Exception as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None


def run_tp2(
    scenario: Callable[[LLMEngine], Any], ckpt, engine_cfg: EngineConfig, deadline_s: float = 120
) -> Any:
    """`scenario(engine)` on rank 0 of a TP=2 group (a module-level function: it is pickled); its
    result (picklable), after the worker exited with 0."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_rank0, args=(scenario, str(ckpt), engine_cfg, local_ranks.free_port(), out))
    proc.start()
    try:
        status, result, detail = out.get(timeout=deadline_s)
    except queue.Empty:
        status, result, detail = "timeout", f"rank 0 gave no result within {deadline_s}s", ""
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        pytest.fail("rank 0 did not exit within 30s after its result")
    assert status == "ok", f"{result}\n{detail}"
    assert detail == [0], f"worker exit codes {detail}"
    return result
