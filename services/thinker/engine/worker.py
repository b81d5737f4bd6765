"""TP ranks 1..N-1: load the shard, then "receive plan -> run" until the exit plan.

A worker never decides anything. When it fails it writes its diagnostic into the group's store and
exits, which breaks the collectives of the other ranks, so they exit too, naming this rank.
Also here: spawning worker processes for tests and benchmarks, with deadlines on every wait.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
from omnistage.common.config import EngineConfig, MemoryConfig
from omnistage.common.log import get_logger, setup_logging
from omnistage.services.thinker.engine.distributed import TPError, TPGroup, init_tp_group
from omnistage.services.thinker.engine.kv_profile import KVProfileError
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.engine.step_plan import PlanKind
from omnistage.services.thinker.engine.warmup import OOMInjection, PhaseTracker, Report, WarmupError

log = get_logger(__name__)


def serve_plans(group: TPGroup, runner: ModelRunner) -> int:
    """Execute rank 0's plans until the exit plan; returns the number of plans run."""
    num_run = 0
    while True:
        plan = group.broadcast_plan()
        if plan.kind is PlanKind.EXIT:
            return num_run
        if plan.kind is PlanKind.RUN:
            runner.execute(plan)
            num_run += 1


def run_worker(
    ckpt_dir: str | Path,
    engine_cfg: EngineConfig,
    dtype: torch.dtype | str,
    device: str,
    rank: int,
    world_size: int,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout_s: float = 120.0,
    idle_timeout_s: float = 3600.0,
    progress: Callable[[int, int], None] | None = None,
    on_ready: Callable[[], None] | None = None,
    memory: MemoryConfig | None = None,
    report: Report | None = None,
    inject: OOMInjection | None = None,
    on_peer_failure: Callable[[str], None] | None = None,
) -> int:
    """Body of a worker process (rank >= 1). Raises TPError naming the first failing rank.

    Start-up is the same as rank 0's (load, size the KV cache, warm up; phases to `report`);
    `on_ready()` runs once that is done. While it runs, another rank's failure ends this one through
    `on_peer_failure(diagnostic)` (default: log and exit the process), even inside a collective.
    """
    group = init_tp_group(rank, world_size, host, port, device, timeout_s, idle_timeout_s)
    if report is not None:
        group.on_fail = lambda diagnostic: report("failed", diagnostic)
    tracker = PhaseTracker(report)
    phase = ""
    with group.failure_watch(on_peer_failure):
        try:
            runner = ModelRunner.from_checkpoint(
                ckpt_dir,
                engine_cfg,
                dtype,
                device,
                group,
                progress,
                memory=memory,
                report=tracker,
                inject=inject,
            )
            if on_ready is not None:
                on_ready()
            phase = "running step plan {n}"
            num_run = serve_plans(group, runner)
        except Exception as exc:
            diagnostic = exc.args[0] if isinstance(exc, TPError | WarmupError | KVProfileError) else ""
            if not group.reported:
                diagnostic = group.report_error(phase.format(n=group.num_plans - 1) or tracker.phase, exc)
            log.error("worker exits: %s", diagnostic)
            raise TPError(diagnostic) from exc
    log.info("worker rank %d leaves after %d steps", rank, num_run)
    group.close()
    return num_run


def _worker_main(kwargs: dict) -> None:
    setup_logging("thinker", rank=kwargs["rank"])
    try:
        run_worker(**kwargs)
    except TPError:
        raise SystemExit(1) from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_workers(
    ckpt_dir: str | Path,
    engine_cfg: EngineConfig,
    world_size: int,
    port: int,
    dtype: torch.dtype | str = "float32",
    device: str = "cpu",
    host: str = "127.0.0.1",
    timeout_s: float = 120.0,
    target=_worker_main,
    memory: MemoryConfig | None = None,
    inject: OOMInjection | None = None,
) -> list[BaseProcess]:
    """Start ranks 1..world_size-1 as spawned processes (tests, benchmarks); rank 0 is the caller."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world_size):
        kwargs = dict(
            ckpt_dir=str(ckpt_dir),
            engine_cfg=engine_cfg,
            dtype=str(dtype).removeprefix("torch."),
            device=device if device == "cpu" else f"cuda:{rank}",
            rank=rank,
            world_size=world_size,
            host=host,
            port=port,
            timeout_s=timeout_s,
            memory=memory,
            inject=inject,
        )
        proc = ctx.Process(target=target, args=(kwargs,), name=f"thinker-rank{rank}")
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
