"""A TP group on GPUs running the peer all-reduce next to NCCL, for the GPU test and
bench/allreduce_gpu.py. Each rank is a spawned process joined through the thinker's own TP group
(`join_tp_group`): it records which path the start-up choice took, then per dtype and message size
whether its sums (eager, and replayed from a CUDA graph) equal the fp32 rank-order sum and every
other rank's bit for bit, and how long a call takes (eager and in a graph) next to NCCL; last, rank 0
calls alone and must stop after the deadline naming rank 1, and its next call must not wait.

`same_gpu`: every rank on cuda:0 (CUDA IPC between processes of one GPU; NCCL refuses two ranks on
one GPU, so its columns are empty). Every wait has a deadline: a rank past its own exits (code 3),
the caller kills what is left and names it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from omnistage.common.config import TPConfig
from omnistage.services.thinker.tp.allreduce_choice import choose_all_reduce
from omnistage.services.thinker.tp.distributed import TPControl, join_tp_group
from omnistage.services.thinker.tp.peer_allreduce import PeerAllReduce, PeerAllReduceStalled, block_bytes
from omnistage.services.thinker.tp.peer_blocks import CudaIpcSharing, open_peer_blocks

from tests.services.thinker.group.local_ranks import free_port, join_workers

KiB = 1024
SIZES = tuple(4 * KiB << i for i in range(9))  # 4 KiB .. 1 MiB
DTYPES = ("bfloat16", "float32")
CAPACITY = 1 << 20


@dataclass(frozen=True)
class PeerCheck:
    """What every rank runs (the same on all: the calls must pair up)."""

    out_dir: str
    world: int = 2
    same_gpu: bool = False
    sizes: tuple[int, ...] = SIZES
    dtypes: tuple[str, ...] = DTYPES
    iters: int = 200  # eager calls timed per size
    graph_calls: int = 20  # calls captured in one graph
    replays: int = 10  # graph replays timed
    stall_s: float = 2.0  # the deadline of the stall check (0: no stall check)
    deadline_s: float = 400.0  # a rank still running after this exits
    port: int = 0

    def device_of(self, rank: int) -> torch.device:
        return torch.device("cuda:0" if self.same_gpu else f"cuda:{rank}")


def run_ranks(check: PeerCheck) -> dict:
    """Spawn the ranks, wait (killing and naming stragglers), merge what they wrote."""
    check = replace(check, port=check.port or free_port())
    env_was = os.environ.pop("TRITON_INTERPRET", None)  # the children compile for the GPU
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(check, r), name=f"rank{r}") for r in range(check.world)]
        for p in procs:
            p.start()
    finally:
        if env_was is not None:
            os.environ["TRITON_INTERPRET"] = env_was
    codes = join_workers(procs, check.deadline_s + 60)
    ranks = [_read(Path(check.out_dir) / f"rank{r}.json") for r in range(check.world)]
    return {"exit_codes": codes, "ranks": ranks, "rows": merged_rows(check, ranks)}


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"error": "no result"}


def merged_rows(check: PeerCheck, ranks: list[dict]) -> list[dict]:
    """Rank 0's times; `equal` only when every rank's sums were right and the same."""
    if any("rows" not in r for r in ranks):
        return []
    rows = []
    for i, row in enumerate(ranks[0]["rows"]):
        equal = all(r["rows"][i]["equal"] for r in ranks)
        rows.append({**row, "tp": check.world, "same_gpu": check.same_gpu, "equal": equal})
    return rows


def rank_main(check: PeerCheck, rank: int) -> None:
    """One rank: its own deadline, the group, the choice, the measurements, the stall check."""
    watchdog = threading.Timer(check.deadline_s, lambda: os._exit(3))
    watchdog.daemon = True
    watchdog.start()
    device = check.device_of(rank)
    tp = TPConfig(startup_collective_timeout_s=120, serving_collective_timeout_s=120)
    control = join_tp_group(rank, check.world, port=check.port, device=str(device), cfg=tp)
    result: dict = {"rank": rank, "device": str(device)}
    try:
        choice = choose_all_reduce(control, "auto", device, 60.0)
        result["choice"] = {"path": choice.path, "reason": choice.reason}
        if choice.reducer is not None:
            choice.reducer.close()  # the benchmark's own blocks hold messages up to 1 MiB
        blocks = open_peer_blocks(
            rank, check.world, block_bytes(CAPACITY), CudaIpcSharing(device), control.gather
        )
        reducer = PeerAllReduce(blocks, device, 60.0, capacity_bytes=CAPACITY)
        result["rows"] = [
            measure(check, control, reducer, nbytes, dtype)
            for dtype in check.dtypes
            for nbytes in check.sizes
        ]
        if check.stall_s:
            result["stall"] = stall(check, control, reducer)
        reducer.close()
    except Exception as exc:  # noqa: BLE001 - written for the caller, then this rank fails
        result["error"] = f"{type(exc).__name__}: {exc}"
    Path(check.out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    control.close()
    os._exit(0 if "error" not in result else 1)


def messages(world: int, n: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Every rank's message for one size: any rank can make every rank's."""
    return [
        torch.randn(n, generator=torch.Generator().manual_seed(1000 * r + n)).to(dtype).to(device)
        for r in range(world)
    ]


def rank_order_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros_like(inputs[0], dtype=torch.float32)
    for x in inputs:
        acc += x.float()
    return acc.to(inputs[0].dtype)


def measure(
    check: PeerCheck, control: TPControl, reducer: PeerAllReduce, nbytes: int, dtype_name: str
) -> dict:
    dtype = getattr(torch, dtype_name)
    n = nbytes // torch.empty(0, dtype=dtype).element_size()
    inputs = messages(check.world, n, dtype, reducer.device)
    want = rank_order_sum(inputs)
    mine = inputs[reducer.launch.rank]
    eager = reducer(mine.clone())
    graph_out = replayed(reducer, mine, want)
    theirs = control.gather(eager.cpu(), f"results {dtype_name} {nbytes}")
    row = {
        "bytes": nbytes,
        "dtype": dtype_name,
        "equal": bool(
            torch.equal(eager, want) and graph_out and all(torch.equal(t, theirs[0]) for t in theirs)
        ),
        "nccl_max_diff": None,
    }
    if not check.same_gpu:
        y = mine.clone()
        dist.all_reduce(y)
        row["nccl_max_diff"] = float((y.float() - eager.float()).abs().max())
    zeros = torch.zeros(n, dtype=dtype, device=reducer.device)
    nccl = None if check.same_gpu else dist.all_reduce
    row["peer_us"], row["peer_graph_us"] = timed(check, control, reducer, zeros)
    row["nccl_us"], row["nccl_graph_us"] = timed(check, control, nccl, zeros) if nccl else (None, None)
    return row


def replayed(reducer: PeerAllReduce, mine: torch.Tensor, want: torch.Tensor) -> bool:
    """The sum captured in a CUDA graph, replayed three times on fresh input: right each time."""
    static = mine.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reducer(static)
    right = True
    for _ in range(3):
        static.copy_(mine)
        graph.replay()
        right = right and bool(torch.equal(static, want))
    return right


def timed(check: PeerCheck, control: TPControl, fn, x: torch.Tensor) -> tuple[float, float]:
    """µs per call: eager (`iters` launches) and in a graph (`graph_calls` per replay)."""
    control.gather(None, "timing")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(check.iters):
        fn(x)
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - start) / check.iters * 1e6
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(check.graph_calls):
            fn(x)
    control.gather(None, "timing a graph")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(check.replays):
        graph.replay()
    torch.cuda.synchronize()
    graph_us = (time.perf_counter() - start) / (check.replays * check.graph_calls) * 1e6
    return round(eager_us, 2), round(graph_us, 2)


def stall(check: PeerCheck, control: TPControl, reducer: PeerAllReduce) -> dict:
    """Rank 0 calls alone: its wait ends at the deadline naming rank 1; its next call does not wait."""
    reducer.set_timeout(check.stall_s)
    control.gather(None, "stall check")
    seen: dict = {}
    if reducer.launch.rank == 0:
        x = torch.ones(1024, device=reducer.device)
        start = time.perf_counter()
        reducer(x)
        torch.cuda.synchronize()
        seen["first_call_s"] = round(time.perf_counter() - start, 3)
        try:
            reducer.check()
        except PeerAllReduceStalled as exc:
            seen["named_rank"], seen["message"] = exc.culprit_rank, str(exc)
        start = time.perf_counter()
        reducer(x)
        torch.cuda.synchronize()
        seen["next_call_s"] = round(time.perf_counter() - start, 3)
    control.gather(None, "stall check done")
    return seen
