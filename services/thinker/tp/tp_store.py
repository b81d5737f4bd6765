"""The TP group's shared store (a TCPStore hosted by rank 0), every call with a deadline."""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, TypeVar

import torch.distributed as dist

T = TypeVar("T")
_FAILURE_KEY = "omnistage/first_failure"
_FAILURE_COUNT_KEY = "omnistage/num_failures"
_ACK_KEY = "omnistage/num_acks"
FailureKind = Literal["failed", "died", "silent", "store_lost"]


class StoreLost(RuntimeError):
    """The store host (rank 0) is gone or did not answer within the deadline."""

    def __init__(self, message: str, *, silent: bool) -> None:
        super().__init__(message)
        self.silent = silent  # True: no reply in time (stopped); False: the connection is gone


@dataclass(frozen=True)
class GroupFailure:
    """The group's first failure: the rank at fault and one line naming it, where, and the cause."""

    rank: int
    message: str
    # failed: the rank reported its own error; died / silent: a peer found it gone / not answering;
    # store_lost: rank 0's store is gone (seen locally, cannot be written anywhere).
    kind: FailureKind = "failed"

    def encode(self) -> str:
        return json.dumps({"rank": self.rank, "message": self.message, "kind": self.kind})

    @classmethod
    def decode(cls, raw: bytes) -> GroupFailure:
        data = json.loads(raw.decode())
        return cls(int(data["rank"]), str(data["message"]), data.get("kind", "failed"))


@dataclass(frozen=True)
class PeerProcess:
    """Where a rank runs: a dead process on our own host is seen at once, others by heartbeat."""

    pid: int
    host: str


class GroupStore:
    """Deadline-bound access to the TP group's TCPStore (one connection of its own)."""

    def __init__(self, host: str, port: int, timeout_s: float, store: dist.Store | None = None) -> None:
        self.timeout_s = timeout_s
        self.lost: StoreLost | None = None
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        # A daemon thread, not a ThreadPoolExecutor: a call stuck on a stopped host must not keep
        # the interpreter from exiting (the executor's threads are joined at exit).
        threading.Thread(target=self._serve_calls, name="tp-store", daemon=True).start()
        self._store = store if store is not None else self._call(lambda: _connect(host, port, timeout_s))

    def _serve_calls(self) -> None:
        while True:
            fn, fut = self._calls.get()
            if fn is None:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

    def _call(self, fn: Callable[[], T]) -> T:
        if self.lost is not None:
            raise self.lost
        if self._closed:
            raise StoreLost("store client closed", silent=False)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        try:
            return fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self.lost = StoreLost(f"a store call got no reply within {self.timeout_s:g}s", silent=True)
        except Exception as exc:  # DistNetworkError, RuntimeError: the host closed the connection
            self.lost = StoreLost(f"{type(exc).__name__}: {_first_line(exc)}", silent=False)
        raise self.lost

    # -- the first failure ------------------------------------------------------------------
    def report(self, failure: GroupFailure) -> GroupFailure:
        """Record `failure` unless another one came first; returns the group's first failure."""

        def first_wins() -> None:
            if self._store.add(_FAILURE_COUNT_KEY, 1) == 1:
                self._store.set(_FAILURE_KEY, failure.encode())

        self._call(first_wins)
        return self.first_failure() or failure

    def first_failure(self) -> GroupFailure | None:
        def read() -> GroupFailure | None:
            if not self._store.check([_FAILURE_KEY]):
                return None
            return GroupFailure.decode(self._store.get(_FAILURE_KEY))

        return self._call(read)

    def acknowledge(self) -> None:
        """This rank has seen the first failure (the store host waits for everyone's before leaving)."""
        self._call(lambda: self._store.add(_ACK_KEY, 1))

    def acknowledgements(self) -> int:
        return int(self._call(lambda: self._store.add(_ACK_KEY, 0)))

    # -- liveness ---------------------------------------------------------------------------
    def beat(self, rank: int) -> int:
        return int(self._call(lambda: self._store.add(f"omnistage/heartbeat/{rank}", 1)))

    def beats(self, ranks: list[int]) -> dict[int, int]:
        return self._call(lambda: {r: int(self._store.add(f"omnistage/heartbeat/{r}", 0)) for r in ranks})

    def publish_process(self, rank: int, process: PeerProcess) -> None:
        self._call(lambda: self._store.set(f"omnistage/process/{rank}", f"{process.pid} {process.host}"))

    def processes(self, ranks: list[int]) -> dict[int, PeerProcess]:
        """The processes of those `ranks` that have published theirs."""

        def read() -> dict[int, PeerProcess]:
            out = {}
            for r in ranks:
                key = f"omnistage/process/{r}"
                if self._store.check([key]):
                    pid, host = self._store.get(key).decode().split(" ", 1)
                    out[r] = PeerProcess(int(pid), host)
            return out

        return self._call(read)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._calls.put((None, None))


def this_process() -> PeerProcess:
    return PeerProcess(os.getpid(), socket.gethostname())


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs on this host: absent, or a zombie waiting to be reaped."""
    if not os.path.isdir("/proc/self"):
        return False  # no procfs: only heartbeats tell
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    except OSError:
        return False
    return state in ("Z", "X")


def _connect(host: str, port: int, timeout_s: float) -> dist.Store:
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]
