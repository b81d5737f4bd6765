"""Ranks of a TP group as spawned processes, without the launcher: for tests and benchmarks that drive
rank 0's engine themselves (`bench/thinker_cpu.py`, `bench/gpu_engine_check.py`, `run_rank0`).
Every wait has a deadline; a rank that does not leave in time is killed and named.

A spawned rank ends like a service rank (`common/runtime/stage_main.py`): without the interpreter's
finalization. A failed worker took 7 s to finalize on a loaded host, its PeerWatch stopped (daemon
threads do there) and its sockets open: rank 0, blocked in an all-reduce with it, stayed blocked, and
rank 0's watch ended rank 0 before it had reported the failure.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from omnistage.common.log import get_logger, setup_logging
from omnistage.common.runtime.deadlines import Deadline
from omnistage.services.thinker.group.startup import RankConfig, start_rank
from omnistage.services.thinker.group.worker import run_plan_loop
from omnistage.services.thinker.tp.distributed import TPError
from omnistage.services.thinker.tp.peer_watch import exit_now
from omnistage.services.thinker.tp.tp_store import process_gone

from tests.waits import timeout_message

log = get_logger(__name__)

# What rank 0's process hands back: ("ok", result, detail) or ("error", message, traceback); the
# parent adds ("died", ...) and ("timeout", ...) when none came.
Outcome = tuple[str, Any, Any]
# Every rank has exited this long after rank 0's outcome, else the test fails (a hang detector: on a
# loaded 2-core machine, 4 ranks once took over 30 s to exit after serving well).
EXIT_WAIT_S = 60


def end_process(code: int) -> NoReturn:
    """End this spawned rank now, its output flushed, without the interpreter's finalization."""
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(code)
    raise AssertionError("unreachable")


def worker_main(cfg: RankConfig) -> NoReturn:
    """A spawned worker rank: start-up, the plan loop; exit 0 after the exit plan, 1 on a failure."""
    setup_logging("thinker", rank=cfg.rank)
    code = 1
    try:
        run_plan_loop(start_rank(cfg))
        code = 0
    except TPError as exc:
        log.error("worker exits: %s", exc)
    except BaseException:  # noqa: BLE001 - logged; the process ends below either way
        log.exception("worker rank %d fails", cfg.rank)
    finally:
        end_process(code)


def free_port() -> int:
    """A port free now (for the group's rendezvous), never handed out before in this process
    (`chaos_launch.free_ports`: the one owner)."""
    from load_tests.chaos_launch import free_ports

    return free_ports(1)[0]


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


# --- rank 0 in a spawned process ------------------------------------------------------------------


def report_outcome(out: mp.Queue, run: Callable[[], tuple[Any, Any]]) -> NoReturn:
    """The end of a spawned rank 0: `run()`'s (result, detail) as ("ok", result, detail), or
    ("error", message, traceback), put on `out` and flushed into the pipe; then the process ends."""
    try:
        outcome: Outcome = ("ok", *run())
    except Exception as exc:  # noqa: BLE001 - the outcome the parent asserts on
        outcome = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    out.put(outcome)
    out.close()
    out.join_thread()
    end_process(0 if outcome[0] == "ok" else 1)


def _rank0_entry(target: Callable[..., None], args: tuple, out: mp.Queue) -> None:
    os.setpgrp()  # the workers it spawns join its process group: the parent waits for all of them
    target(*args, out)


def run_rank0(target: Callable[..., None], args: tuple, wait_s: float) -> Outcome:
    """Spawn rank 0 as `target(*args, out)` (it spawns its workers and ends with `report_outcome`) and
    return its outcome once every rank has exited. A rank 0 that ends without an outcome is reported
    at once with its exit code; a rank still running `EXIT_WAIT_S` after it (a worker left waiting
    for a plan) fails, named. Whatever is left of the group is killed."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_rank0_entry, args=(target, args, out), name="thinker-rank0")
    proc.start()
    try:
        outcome = _wait_outcome(proc, out, wait_s)
        if outcome[0] in ("ok", "error"):
            _wait_group_gone(proc, EXIT_WAIT_S)
        return outcome
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.join(5)


def _wait_outcome(proc: BaseProcess, out: mp.Queue, wait_s: float) -> Outcome:
    deadline = Deadline(wait_s)
    while not deadline.expired():
        try:
            return out.get(timeout=min(0.5, deadline.remaining()))
        except queue.Empty:
            pass
        if not proc.is_alive():  # an outcome put before the exit is in the pipe by now
            try:
                return out.get(timeout=1)
            except queue.Empty:
                return ("died", f"rank 0 exited with code {proc.exitcode} without an outcome", "")
    return ("timeout", timeout_message(wait_s, "rank 0's outcome", "thinker", 0), "")


def _wait_group_gone(proc: BaseProcess, timeout_s: float) -> None:
    """Wait until rank 0 and every process of its group (its workers) have exited, else raise naming
    those still running."""
    deadline = Deadline(timeout_s)
    proc.join(deadline.remaining())
    while (running := _running_in_group(proc.pid)) and not deadline.expired():
        time.sleep(0.05)
    if running:
        raise TimeoutError(
            timeout_message(timeout_s, f"TP ranks {running} (pids) to exit after rank 0's outcome", "thinker")
        )


def _running_in_group(pgid: int) -> list[int]:
    """The processes of process group `pgid` still running (zombies waiting to be reaped are not)."""
    running = []
    for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()):
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pgid and not process_gone(pid):
                running.append(pid)
    return running
