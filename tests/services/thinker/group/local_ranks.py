"""Ranks 1..N-1 of a TP group as spawned processes, without the launcher: for tests and benchmarks
that drive rank 0's engine in their own process (`bench/thinker_cpu.py`, `bench/gpu_engine_check.py`).
Every wait has a deadline; a rank that does not leave in time is killed and named.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from omnistage.common.log import get_logger, setup_logging
from omnistage.common.runtime.deadlines import Deadline
from omnistage.services.thinker.group.startup import RankConfig, start_rank
from omnistage.services.thinker.group.worker import run_plan_loop
from omnistage.services.thinker.tp.distributed import TPError

from tests.waits import timeout_message

log = get_logger(__name__)


def worker_main(cfg: RankConfig) -> None:
    """A spawned worker rank: start-up, the plan loop, exit 1 on the group's failure."""
    setup_logging("thinker", rank=cfg.rank)
    try:
        run_plan_loop(start_rank(cfg))
    except TPError as exc:
        log.error("worker exits: %s", exc)
        raise SystemExit(1) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_workers(cfg: RankConfig, target: Callable[[RankConfig], None] = worker_main) -> list[BaseProcess]:
    """Start ranks 1..world_size-1 of `cfg` as spawned processes; rank 0 is the caller."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, cfg.world_size):
        proc = ctx.Process(target=target, args=(cfg.for_rank(rank),), name=f"thinker-rank{rank}")
        proc.start()
        procs.append(proc)
    return procs


def join_workers(procs: list[BaseProcess], timeout_s: float) -> list[int]:
    """Wait for all workers to exit; kill and raise naming the stragglers after `timeout_s`."""
    deadline = Deadline(timeout_s)
    for proc in procs:
        proc.join(deadline.remaining())
    stuck = [p.name for p in procs if p.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    if stuck:
        raise TimeoutError(
            timeout_message(timeout_s, f"TP workers {', '.join(stuck)} to exit", stage="thinker")
        )
    return [p.exitcode for p in procs]
