"""The TP group of the thinker: rendezvous, StepPlan broadcast, agree-on-minimum, failure reports.

Two process groups share one TCPStore (hosted by rank 0): the model's group (nccl on CUDA, gloo on
CPU; deadline `timeout_s` per collective) and a gloo group for plans and start-up agreement whose
deadline `idle_timeout_s` bounds how long a worker waits for rank 0's next plan. The first rank to
fail writes one diagnostic into the store; every other rank's collective error names it, so all
ranks exit with the same cause instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from omnistage.common.log import get_logger
from omnistage.services.thinker.engine.step_plan import StepPlan

log = get_logger(__name__)
T = TypeVar("T")
_ERROR_KEY = "omnistage/first_error"
_ERROR_COUNT_KEY = "omnistage/num_errors"
_ACK_KEY = "omnistage/num_acks"


class TPError(RuntimeError):
    """A collective of the TP group failed or timed out; the message names rank, phase and cause."""


class TPGroup:
    """This process's membership in the thinker's TP group."""

    def __init__(self, rank: int, world_size: int, store: dist.Store | None, plan_group) -> None:
        self.rank = rank
        self.world_size = world_size
        # Called with this rank's own diagnostic as soon as it is reported (before rank 0 lingers for
        # the others' acknowledgements), so this rank's status says "failed" first and names the cause.
        self.on_fail: Callable[[str], None] | None = None
        self.store = store
        self.plan_group = plan_group
        self.num_plans = 0
        # Set once this rank has reported its own failure (its watchdog must not fire on it).
        self.reported = False
        self._acked = False

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def broadcast_plan(self, plan: StepPlan | None = None) -> StepPlan:
        """Rank 0 passes its plan, the others receive it (length first, then the int64 payload)."""
        if not self.is_distributed:
            assert plan is not None
            return plan
        phase = f"step plan {self.num_plans} broadcast"
        buf = plan.encode() if self.rank == 0 else None
        length = torch.tensor([buf.numel() if buf is not None else 0], dtype=torch.int64)
        self.guard(phase, lambda: dist.broadcast(length, src=0, group=self.plan_group))
        if buf is None:
            buf = torch.empty(int(length.item()), dtype=torch.int64)
        self.guard(phase, lambda: dist.broadcast(buf, src=0, group=self.plan_group))
        self.num_plans += 1
        return plan if plan is not None else StepPlan.decode(buf)

    def agree_min(self, value: int, phase: str = "agree_min") -> int:
        """All ranks get the smallest of their values (start-up numbers, skip decisions)."""
        if not self.is_distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self.guard(phase, lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.plan_group))
        return int(t.item())

    def report_error(self, phase: str, exc: BaseException) -> str:
        """Record this rank's failure; the first report of the group wins. Returns the diagnostic."""
        msg = f"rank {self.rank} failed in {phase}: {type(exc).__name__}: {exc}"
        self.reported = True
        if self.store is None:
            return msg
        try:
            if self.store.add(_ERROR_COUNT_KEY, 1) == 1:
                self.store.set(_ERROR_KEY, msg)
        except Exception:  # the store lives on rank 0; when it is gone the local message is all we have
            pass
        return self.first_error() or msg

    def fail(self, phase: str, exc: BaseException, linger_s: float = 5.0) -> str:
        """report_error, and on rank 0 (which hosts the store) wait up to `linger_s` until every other
        rank has read the diagnostic, so none of them is left with "rank 0 is gone" instead."""
        diagnostic = self.report_error(phase, exc)
        if self.on_fail is not None:
            self.on_fail(diagnostic)
        if self.rank == 0 and self.is_distributed and self.store is not None:
            deadline = time.monotonic() + linger_s
            while time.monotonic() < deadline:
                try:
                    if self.store.add(_ACK_KEY, 0) >= self.world_size - 1:
                        break
                except Exception:
                    break
                time.sleep(0.05)
        return diagnostic

    def acknowledge(self) -> None:
        """Tell the failing rank that this rank has read the group's first failure."""
        if self.store is None or self._acked:
            return
        self._acked = True
        try:
            self.store.add(_ACK_KEY, 1)
        except Exception:
            pass

    def first_error(
        self, store_lost: str | None = "rank 0 is gone (its store no longer answers)"
    ) -> str | None:
        """The group's first reported failure; `store_lost` when the store (on rank 0) cannot answer."""
        if self.store is None:
            return None
        try:
            if self.store.check([_ERROR_KEY]):
                return self.store.get(_ERROR_KEY).decode()
        except Exception:
            return store_lost
        return None

    def guard(self, phase: str, fn: Callable[[], T]) -> T:
        """Run `fn` (a collective, or a forward containing them); failures become TPError naming the
        rank, the phase and the group's first failure."""
        try:
            return fn()
        except Exception as exc:
            first = self.first_error()
            if first:
                self.acknowledge()
            cause = f"; first failure: {first}" if first else ""
            raise TPError(f"rank {self.rank}: {phase} failed ({type(exc).__name__}: {exc}){cause}") from exc

    def agree_all(self, ok: bool, phase: str) -> tuple[bool, int]:
        """(every rank is ok, the first rank that is not — world_size when none): one MIN all-reduce."""
        first_bad = self.agree_min(self.world_size if ok else self.rank, phase)
        return first_bad == self.world_size, first_bad

    @contextlib.contextmanager
    def failure_watch(
        self, on_failure: Callable[[str], None] | None = None, poll_s: float = 0.5
    ) -> Iterator[None]:
        """While inside, another rank's reported failure ends this rank promptly, even when it is
        blocked in a collective that would otherwise wait for its timeout (NCCL never notices a dead
        peer). `on_failure(diagnostic)` must not return; the default logs and exits the process."""
        if not self.is_distributed or self.store is None:
            yield
            return
        stop = threading.Event()
        handler = on_failure or _exit_on_peer_failure

        def watch() -> None:
            while not stop.wait(poll_s):
                diagnostic = self.first_error(store_lost=None)
                if diagnostic and not self.reported:
                    self.acknowledge()
                    handler(diagnostic)
                    return

        thread = threading.Thread(target=watch, daemon=True, name=f"tp-watchdog-rank{self.rank}")
        thread.start()
        try:
            yield
        finally:
            stop.set()

    def close(self) -> None:
        if self.is_distributed and dist.is_initialized():
            dist.destroy_process_group()


def _exit_on_peer_failure(diagnostic: str) -> None:
    log.error("rank exits: %s", diagnostic)
    logging.shutdown()
    os._exit(1)


def init_tp_group(
    rank: int,
    world_size: int,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "cpu",
    timeout_s: float = 120.0,
    idle_timeout_s: float = 3600.0,
) -> TPGroup:
    """Join the TP group (every rank calls this); world_size 1 needs no rendezvous."""
    if world_size == 1:
        return TPGroup(0, 1, None, None)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a TP group of {world_size}")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    else:
        # CPU ranks share the host's cores: one intra-op pool per rank oversubscribes them (seen:
        # TP=2 on 2 cores ran 100x slower with 2 threads per rank than with 1).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=True,
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("model", store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        plan_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=idle_timeout_s))
    except Exception as exc:
        raise TPError(
            f"rank {rank}: TP rendezvous at {host}:{port} ({world_size} ranks, {backend}, pid {os.getpid()}) "
            f"failed within {timeout_s:.0f}s: {type(exc).__name__}: {exc}"
        ) from exc
    log.info("joined TP group rank %d/%d (%s) at %s:%d", rank, world_size, backend, host, port)
    return TPGroup(rank, world_size, store, plan_group)
