"""TPControl: the thinker's TP group as the engine sees it — plans, agreement, failures, deadlines."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from omnistage.common.config import TPConfig
from omnistage.common.log import get_logger
from omnistage.services.thinker.tp.peer_watch import PeerWatch
from omnistage.services.thinker.tp.plan import PlanKind, StepPlan
from omnistage.services.thinker.tp.tp_store import GroupFailure, GroupStore, StoreLost, this_process

log = get_logger(__name__)
T = TypeVar("T")

# A step plan's first message to the other ranks (its length, then the payload): 4,096 int64s (32 KiB) hold
# a decode step's plan (8 int64s a sequence plus its block-table row) at one sequence for any context, at
# 8 up to ~8k tokens each, at 64 up to ~900: one broadcast a step there; a larger plan takes a second.
PLAN_INLINE_INT64S = 4096
FailureListener = Callable[[GroupFailure], None]


class TPError(RuntimeError):
    """This rank leaves because of the group's first failure (its message names rank, where, cause)."""

    def __init__(self, failure: GroupFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure

    @property
    def culprit_rank(self) -> int:
        """The rank at fault (read by the service runtime, which knows no TP types)."""
        return self.failure.rank


def broadcast_int64s(buf: torch.Tensor | None, send: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """The source's int64 buffer (`buf`; None on the others) on every rank through `send` (a broadcast
    from the source): one message of PLAN_INLINE_INT64S holding the length and as much as fits, a
    second with the rest only when it does not fit."""
    head = torch.zeros(PLAN_INLINE_INT64S, dtype=torch.int64)
    if buf is not None:
        head[0] = buf.numel()
        head[1 : 1 + min(buf.numel(), PLAN_INLINE_INT64S - 1)] = buf[: PLAN_INLINE_INT64S - 1]
    send(head)
    length = int(head[0])
    if length <= PLAN_INLINE_INT64S - 1:
        return buf if buf is not None else head[1 : 1 + length]
    rest = (
        buf[PLAN_INLINE_INT64S - 1 :]
        if buf is not None
        else torch.empty(length - PLAN_INLINE_INT64S + 1, dtype=torch.int64)
    )
    send(rest)
    return buf if buf is not None else torch.cat([head[1:], rest])


class TPControl:
    """This process's membership in the thinker's TP group (world size 1: every call is local)."""

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        cfg: TPConfig | None = None,
        store: GroupStore | None = None,
        plan_group: dist.ProcessGroup | None = None,
        host_store: dist.Store | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.cfg = cfg or TPConfig()
        self.store = store
        self.plan_group = plan_group
        self._host_store = host_store  # rank 0: the TCPStore server lives as long as this object
        self.num_plans = 0
        self.plan_messages = 0  # broadcasts the plans took (one a plan that fits PLAN_INLINE_INT64S)
        self.serving = False
        # Set before the exit plan: peers leaving now is the plan, not a failure.
        self.leaving = False
        self.failure: GroupFailure | None = None
        # Set once this rank's own code takes a failure up (fail()): it is out of its collectives and
        # reporting, and the PeerWatch gives it the whole exit budget to leave.
        self.unwinding = False
        self._phase = "start-up"
        self._closed = False
        self._listeners: list[FailureListener] = []
        self._closers: list[Callable[[], None]] = []
        self._checks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.watch = PeerWatch(self) if self.is_distributed and store is not None else None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def where(self) -> str:
        """What this rank is doing, for diagnostics: a start-up phase, or `serving (step N)`."""
        return f"serving (step {self.num_plans})" if self.serving else self._phase

    def set_phase(self, phase: str) -> None:
        self._phase = phase

    @property
    def exit_budget_s(self) -> float:
        """Time a rank has from noticing a failure to its exit (a silent peer takes peer_timeout_s
        to notice, so the whole group is gone within failure_exit_s)."""
        return max(self.cfg.failure_exit_s - self.cfg.peer_timeout_s, 2 * self.cfg.peer_watch_interval_s)

    @property
    def culprit_wait_s(self) -> float:
        """How long a rank whose collective broke waits for the peer to blame before blaming itself."""
        return max(2 * self.cfg.peer_watch_interval_s, min(self.cfg.peer_timeout_s, self.exit_budget_s / 2))

    def add_failure_listener(self, fn: FailureListener) -> None:
        """`fn(failure)` runs once, from whichever thread first learns of the group's failure (it
        must not block: it marks the service failed, fails in-flight requests)."""
        self._listeners.append(fn)
        if self.failure is not None:
            _call_listener(fn, self.failure)

    def on_close(self, fn: Callable[[], None]) -> None:
        """`fn()` runs in `close()` before the process groups are destroyed (what must go first:
        CUDA graphs that captured collectives)."""
        self._closers.append(fn)

    def add_check(self, fn: Callable[[], None]) -> None:
        """`fn()` runs before each of the group's collectives (step plans, agreements) and raises
        when it finds the group broken where no collective of torch's would say so (a peer
        all-reduce that timed out on the device): the group fails there, naming the exception's
        `culprit_rank` when it has one."""
        self._checks.append(fn)

    # --- collectives ------------------------------------------------------------------------

    def enter_serving(self) -> None:
        """Start-up is over on this rank: collectives get the serving deadline from now on."""
        self.serving = True
        if not self.is_distributed:
            return
        timeout = timedelta(seconds=self.cfg.serving_collective_timeout_s)
        try:
            from torch.distributed.distributed_c10d import _set_pg_timeout
        except ImportError:  # older torch: the start-up deadline stays (the PeerWatch still bounds exits)
            log.warning(
                "this torch cannot change a process group's timeout: collectives keep the start-up one"
            )
            return
        _set_pg_timeout(timeout)
        _set_pg_timeout(timeout, self.plan_group)

    def broadcast_plan(self, plan: StepPlan | None = None) -> StepPlan:
        """Rank 0 passes its plan, the others receive it: one message of PLAN_INLINE_INT64S int64s
        (its length, then as much of the payload as fits: a decode step's whole plan), and a second
        with the rest only for a plan that does not fit (a long prefill chunk's)."""
        if not self.is_distributed:
            assert plan is not None
            return plan
        if plan is not None and plan.kind is PlanKind.EXIT:
            self.leaving = True
        where = f"step plan {self.num_plans} broadcast"

        def send(t: torch.Tensor) -> None:
            self.guard(where, lambda: dist.broadcast(t, src=0, group=self.plan_group))
            self.plan_messages += 1

        buf = broadcast_int64s(plan.encode() if self.rank == 0 else None, send)
        self.num_plans += 1
        received = plan if plan is not None else StepPlan.decode(buf)
        if received.kind is PlanKind.EXIT:
            self.leaving = True
        return received

    def agree_min(self, value: int, what: str = "agree_min") -> int:
        """All ranks get the smallest of their values (start-up numbers, skip decisions)."""
        if not self.is_distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self.guard(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.plan_group))
        return int(t.item())

    def gather(self, value: object, what: str) -> list:
        """Every rank's `value` (picklable) in rank order: start-up decisions that need each rank's
        answer, not only the smallest."""
        if not self.is_distributed:
            return [value]
        values: list = [None] * self.world_size
        self.guard(what, lambda: dist.all_gather_object(values, value, group=self.plan_group))
        return values

    def agree_all(self, ok: bool, what: str) -> tuple[bool, int]:
        """(every rank is ok, the first rank that is not — world_size when none): one MIN all-reduce."""
        first_bad = self.agree_min(self.world_size if ok else self.rank, what)
        return first_bad == self.world_size, first_bad

    def guard(self, where: str, fn: Callable[[], T]) -> T:
        """Run `fn` (a collective) after the checks; a failure becomes TPError naming the group's
        first failure."""
        try:
            for check in self._checks:
                check()
            return fn()
        except Exception as exc:
            culprit = getattr(exc, "culprit_rank", None)
            raise TPError(self.fail(where, exc, collective=True, culprit=culprit)) from exc

    # --- failures ---------------------------------------------------------------------------

    def fail(
        self, where: str, exc: BaseException, *, collective: bool = False, culprit: int | None = None
    ) -> GroupFailure:
        """This rank cannot go on. Returns the group's first failure: one already reported, a peer
        found dead now (when a collective broke), or this rank's own error, which it reports. The
        store host then keeps the store up until every rank has read it (bounded). `culprit`: the
        rank to blame when all ranks agreed to fail because of one (a KV size it could not hold)."""
        self.unwinding = True
        if self.watch is not None:
            self.watch.wake()
        # Another rank is to blame for a failure all agreed on: its own report (with its cause)
        # should be the group's, so give it the moment a broken collective gets too. A forward whose
        # all-reduce broke is a broken collective as well: a peer that died closes its sockets before
        # its process is gone, so this rank may notice first and must not blame itself.
        collective = collective or (self.is_distributed and broken_collective(exc))
        failure = self._diagnose(collective or culprit not in (None, self.rank))
        if failure is None:
            rank = self.rank if culprit is None else culprit
            own = GroupFailure(rank, f"rank {rank} failed in {where}: {type(exc).__name__}: {_line(exc)}")
            failure = self._report(own)
        self.notice(failure)
        if self.rank == 0 and self.is_distributed:
            self.wait_for_acknowledgements(failure, self.exit_budget_s / 2)
        return failure

    def report_peer(self, peer: int, kind: str, detail: str) -> GroupFailure:
        """A peer died or stopped answering (the PeerWatch saw it); returns the first failure."""
        verb = "died" if kind == "died" else "stopped answering"
        return self._report(GroupFailure(peer, f"rank {peer} {verb} while {self.where}: {detail}", kind))  # type: ignore[arg-type]

    def store_lost(self, lost: StoreLost) -> GroupFailure:
        verb = "stopped answering" if lost.silent else "is gone"
        return GroupFailure(0, f"rank 0 (store host) {verb} while {self.where}: {lost}", "store_lost")

    def first_failure(self) -> GroupFailure | None:
        """The group's first failure (a lost store is one), or None."""
        if self.failure is not None:
            return self.failure
        if self.store is None:
            return None
        try:
            return self.store.first_failure()
        except StoreLost as lost:
            return self.store_lost(lost)

    def notice(self, failure: GroupFailure) -> bool:
        """Record the group's failure on this rank (once): acknowledge it, tell the listeners."""
        with self._lock:
            if self.failure is not None:
                return False
            self.failure = failure
        log.error("TP group failed: %s", failure.message)
        if self.store is not None and failure.kind != "store_lost":
            try:
                self.store.acknowledge()
            except StoreLost:
                pass
        for fn in list(self._listeners):
            _call_listener(fn, failure)
        if self.watch is not None:
            self.watch.wake()
        return True

    def wait_for_acknowledgements(self, failure: GroupFailure, timeout_s: float) -> bool:
        """Store host only: wait until every live rank has read `failure` (else they would only see
        "store gone"); a rank that died or stopped answering never will."""
        if self.store is None:
            return True
        expected = self.world_size - (0 if failure.kind == "failed" else 1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.store.acknowledgements() >= expected:
                    return True
            except StoreLost:
                return False
            time.sleep(0.05)
        return False

    def _diagnose(self, collective: bool) -> GroupFailure | None:
        failure = self.first_failure()
        if failure is not None or not self.is_distributed or self.watch is None:
            return failure
        failure = self.watch.find_dead_peer()
        if failure is not None or not collective:
            return failure
        # A collective broke with no culprit known yet: give the watches time to name one (a peer
        # on another host, or stopped, is named only once its heartbeat is peer_timeout_s old).
        deadline = time.monotonic() + self.culprit_wait_s
        while failure is None and time.monotonic() < deadline:
            time.sleep(self.cfg.peer_watch_interval_s / 4)
            failure = self.first_failure() or self.watch.find_dead_peer()
        return failure

    def _report(self, failure: GroupFailure) -> GroupFailure:
        if self.store is None:
            return failure
        try:
            return self.store.report(failure)
        except StoreLost as lost:
            return failure if failure.rank == self.rank else self.store_lost(lost)

    def close(self) -> None:
        """Leave the group: stop the watch; the store host lingers while a failure is being read.
        After a failure the process groups are not destroyed (that can block on a broken NCCL
        communicator); the process exits anyway."""
        if self._closed:
            return
        self._closed = True
        if self.failure is not None and self.rank == 0 and self.is_distributed:
            self.wait_for_acknowledgements(self.failure, self.exit_budget_s / 2)
        self.leaving = True
        if self.watch is not None:
            self.watch.stop()
        for fn in self._closers:
            _call_closer(fn)
        if self.failure is None and self.is_distributed and dist.is_initialized():
            self._destroy_groups()
        if self.store is not None:
            self.store.close()

    def _destroy_groups(self) -> None:
        """Destroy the process groups within the exit budget: a communicator that cannot be torn
        down (a peer gone, a graph still holding it) is left to the process exit, with a warning,
        instead of blocking the rank's exit for good."""
        done = threading.Event()

        def destroy() -> None:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - leaving goes on; the process exit frees the rest
                log.exception("rank %d: destroying the process groups failed", self.rank)
            finally:
                done.set()

        threading.Thread(target=destroy, name=f"tp-destroy-rank{self.rank}", daemon=True).start()
        if not done.wait(self.exit_budget_s):
            log.warning(
                "rank %d: process groups not destroyed within %.0fs (%s): left to the process exit",
                self.rank,
                self.exit_budget_s,
                self.where,
            )


def _call_closer(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - leaving the group goes on
        log.exception("TP close hook %r failed", fn)


def _call_listener(fn: FailureListener, failure: GroupFailure) -> None:
    try:
        fn(failure)
    except Exception:  # noqa: BLE001 - one broken listener must not stop the others or the exit
        log.exception("TP failure listener %r failed", fn)


_COMMUNICATION = re.compile(r"gloo|nccl|connection (closed|reset|refused)|broken pipe|socket", re.IGNORECASE)


def broken_collective(exc: BaseException) -> bool:
    """Whether `exc` says a collective's transport broke (a peer gone), not this rank's own error."""
    dist_error = getattr(dist, "DistError", None)
    return (dist_error is not None and isinstance(exc, dist_error)) or bool(_COMMUNICATION.search(str(exc)))


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:2000]


def join_tp_group(
    rank: int,
    world_size: int,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "cpu",
    cfg: TPConfig | None = None,
) -> TPControl:
    """Join the TP group (every rank calls this) and start its PeerWatch; size 1 needs no rendezvous."""
    cfg = cfg or TPConfig()
    if world_size == 1:
        return TPControl(0, 1, cfg)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a TP group of {world_size}")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    else:
        # CPU ranks share the host's cores: one intra-op pool per rank oversubscribes them (seen:
        # TP=2 on 2 cores ran 100x slower with 2 threads per rank than with 1). Never more than the
        # rank's share of the deployment's (common/runtime/cpu_share.py: other CPU stages share them too).
        share = (os.cpu_count() or 1) // world_size
        torch.set_num_threads(max(1, min(torch.get_num_threads(), share)))
    timeout = timedelta(seconds=cfg.startup_collective_timeout_s)
    try:
        host_store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("model", host_store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        plan_group = dist.new_group(backend="gloo", timeout=timeout)
        store = GroupStore(host, port, timeout_s=cfg.peer_timeout_s)
        store.publish_process(rank, this_process())
    except Exception as exc:
        raise TPError(
            GroupFailure(
                rank,
                f"rank {rank}: TP rendezvous at {host}:{port} ({world_size} ranks, {backend}, pid {os.getpid()}) "
                f"failed within {cfg.startup_collective_timeout_s:.0f}s: {type(exc).__name__}: {_line(exc)}",
            )
        ) from exc
    control = TPControl(rank, world_size, cfg, store, plan_group, host_store if rank == 0 else None)
    control.watch.start()
    log.info("joined TP group rank %d/%d (%s) at %s:%d", rank, world_size, backend, host, port)
    return control
