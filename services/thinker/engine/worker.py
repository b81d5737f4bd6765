"""TP ranks 1..N-1 after start-up: "receive plan -> run" until the exit plan.

A worker never decides anything. When it fails it reports to the group's store and leaves; its
PeerWatch (and every other rank's) ends the group within `tp.failure_exit_s`.
Also here: spawning worker processes for tests and benchmarks, with deadlines on every wait.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from omnistage.common.log import get_logger, setup_logging
from omnistage.services.thinker.engine.distributed import TPControl, TPError
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.engine.startup import RankConfig, StartedRank, StartupProgress, start_rank
from omnistage.services.thinker.engine.step_plan import PlanKind

log = get_logger(__name__)


def serve_plans(control: TPControl, runner: ModelRunner) -> int:
    """Execute rank 0's plans until the exit plan; returns the number of plans run. A failed forward
    is reported to the group (TPError naming the group's first failure)."""
    num_run = 0
    while True:
        plan = control.broadcast_plan()
        if plan.kind is PlanKind.EXIT:
            return num_run
        if plan.kind is PlanKind.RUN:
            try:
                runner.execute(plan)
            except Exception as exc:
                raise TPError(control.fail(f"step {control.num_plans - 1} forward", exc)) from exc
            num_run += 1


def run_plan_loop(started: StartedRank) -> int:
    """A started worker's life until the exit plan; leaves the group on the way out."""
    num_run = serve_plans(started.control, started.runner)
    log.info("worker rank %d leaves after %d steps", started.cfg.rank, num_run)
    started.control.close()
    return num_run


def run_worker(cfg: RankConfig, progress: StartupProgress | None = None) -> int:
    """Body of a worker process (rank >= 1): start-up, then the plan loop. Raises TPError."""
    return run_plan_loop(start_rank(cfg, progress))


def _worker_main(cfg: RankConfig) -> None:
    setup_logging("thinker", rank=cfg.rank)
    try:
        run_worker(cfg)
    except TPError as exc:
        log.error("worker exits: %s", exc)
        raise SystemExit(1) from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_workers(cfg: RankConfig, target: Callable[[RankConfig], None] = _worker_main) -> list[BaseProcess]:
    """Start ranks 1..world_size-1 of `cfg` as spawned processes (tests, benchmarks); rank 0 is the caller."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, cfg.world_size):
        proc = ctx.Process(target=target, args=(cfg.for_rank(rank),), name=f"thinker-rank{rank}")
        proc.start()
        procs.append(proc)
    return procs


def join_workers(procs: list[BaseProcess], timeout_s: float) -> list[int]:
    """Wait for all workers to exit; kill and raise naming the stragglers after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    stuck = [p.name for p in procs if p.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    if stuck:
        raise TimeoutError(f"TP workers {', '.join(stuck)} did not exit within {timeout_s:.0f}s")
    return [p.exitcode for p in procs]
