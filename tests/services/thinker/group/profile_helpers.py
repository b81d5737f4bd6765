"""Helpers of the KV auto-profile and warm-up tests: a metered tiny thinker, an allocation recorder,
and a TP rank body for spawned processes that writes its outcome to a file."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from omnistage.common.config import EngineConfig, FaultConfig, MemoryConfig, TPConfig
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.models.loader import load_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MiB = 1 << 20
# Imported by torch on demand: the dynamo wrapper of a dispatch mode's first call (the simulated
# device's meter), `empty_like` of a meta tensor (materialising a model built on meta).
COMPILER_MODULES = {"torch._dynamo", "sympy"}
CFG = EngineConfig(
    block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, kv_canary_bytes=MiB
)


def metered_runner(ckpt: Path, mem: SimulatedDeviceMemory, cfg: EngineConfig = CFG) -> ModelRunner:
    """The tiny thinker loaded inside `mem.meter()` (weights counted), with no KV cache yet."""
    with mem.meter():
        model = load_model(ckpt, dtype=torch.float32, device="cpu")
    blocks = -(-cfg.max_model_len // cfg.block_size)
    return ModelRunner(model, resolve_engine_config(cfg, blocks), "cpu", allocate=False)


class AllocationRecorder(TorchDispatchMode):
    """Records (shape, dtype) of every tensor an aten op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.tensors.append((tuple(t.shape), t.dtype))
        return out


# Deadlines for multi-process tests (the bounds under test scale with them).
# A start-up collective waits longer than run_ranks' deadline: a rank that a peer's failure did not end
# (its watch) is still running there, named, instead of leaving later by its collective's own timeout.
# A peer's silence is 30 s: on a loaded 2-core machine a starting rank's heartbeat was seen 4 s, then
# 10 s late (a rank retrying its KV rebuild: each caught OOM's gc.collect holds the GIL), and the group
# failed blaming that rank's silence instead of the fault under test. No test here waits on a silence
# (every failure is reported, seen within one watch interval), so the margin costs nothing; the exit
# budget after a failure stays 4 s (failure_exit_s − peer_timeout_s).
TP_TEST = TPConfig(
    startup_collective_timeout_s=600,
    serving_collective_timeout_s=60,
    failure_exit_s=34,
    peer_watch_interval_s=0.2,
    peer_timeout_s=30,
)


def tp_rank(kwargs: dict) -> None:
    """Body of one spawned TP rank: start-up (load, profile, warm up) on a simulated device, then
    write {"status", "message", "culprit", "noticed_unix", ...} to `out_dir/rank{r}.json` (first
    writer wins: the group failure seen by any thread, or this rank's own outcome) and exit."""
    from omnistage.common.log import setup_logging
    from omnistage.services.thinker.group import startup
    from omnistage.services.thinker.group.startup import LogProgress, RankConfig, StartupError, start_rank

    rank, out = kwargs["rank"], Path(kwargs["out_dir"]) / f"rank{kwargs['rank']}.json"
    setup_logging("thinker", rank=rank)
    lock, written = threading.Lock(), [False]

    def write(status: str, message: str, **extra: Any) -> None:
        with lock:
            if not written[0]:
                tmp = out.with_suffix(".tmp")
                tmp.write_text(json.dumps({"status": status, "message": message, **extra}))
                tmp.rename(out)
                written[0] = True

    class Progress(LogProgress):
        def failed(self, failure) -> None:
            write("failed", failure.message, culprit=failure.rank, noticed_unix=time.time())

    capacity = kwargs["capacity"]  # 0: a plain CPU (no simulated device, no KV auto-profile)
    peer = kwargs.get("peer_bytes", {}).get(str(rank))
    if peer:
        mem = SimulatedDeviceMemory(capacity)
        mem.reserve(peer, "peer stage")
        startup.device_memory_for = lambda device, simulated=None: mem
    fault = FaultConfig(**kwargs["fault"]) if kwargs.get("fault") else None
    engine = dataclasses.replace(CFG, kv_canary_bytes=kwargs.get("canary_bytes", CFG.kv_canary_bytes))
    if kwargs.get("validation_extra_bytes"):
        _grow_validation_steps(kwargs["validation_extra_bytes"])
    cfg = RankConfig(
        kwargs["ckpt"],
        engine,
        MemoryConfig(simulated_capacity_bytes=capacity),
        TP_TEST,
        rank=rank,
        world_size=kwargs.get("world_size", 2),
        dist_port=kwargs["port"],
        fault=fault,
        warmup=kwargs.get("warmup", True),
    )
    try:
        started = start_rank(cfg, Progress(rank))
    except StartupError as exc:
        write("error", str(exc), culprit=exc.failure.rank)
        os._exit(1)
    prof = started.kv_profile
    write(
        "ok",
        "",
        blocks=started.runner.num_kv_blocks,
        proposed=prof.proposed_blocks,
        cap=prof.cap_bytes,
        attempts=prof.attempts,
        # What the start-up imported of torch's compiler stack (~3 s of CPU per rank when it does).
        compiler_modules=sorted(COMPILER_MODULES & set(sys.modules)),
    )
    started.control.leaving = True  # every rank sets it before the last barrier: nobody sees a "death"
    started.control.agree_min(0, "test done")
    started.control.close()
    os._exit(0)


def _grow_validation_steps(extra_bytes: int) -> None:
    """Every stress step after the probe's (the validation's) holds `extra_bytes` more than measured:
    the rounding a huge cache brings on a real GPU, made deterministic."""
    from omnistage.services.thinker.group import kv_profile

    probe_steps, calls, step = 2, [0], kv_profile.run_dummy_step

    def grown(runner, shape, sampler=None):
        calls[0] += 1
        extra = torch.empty(extra_bytes, dtype=torch.uint8) if calls[0] > probe_steps else None
        step(runner, shape, sampler)
        del extra

    kv_profile.run_dummy_step = grown


def run_ranks(ckpt: Path, out_dir: Path, world_size: int = 2, deadline_s: float = 240, **scenario: Any):
    """Spawn `world_size` ranks of `tp_rank`; returns (results by rank, exit times by rank (Unix
    seconds, as `noticed_unix`), start time). Fails naming the ranks still running at the deadline
    (a hang detector below pytest-timeout's 300 s: on a loaded 2-core machine two ranks that retried
    their KV rebuild 4 times were still starting at 150 s)."""
    import multiprocessing as mp

    from tests.services.thinker.group.local_ranks import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = []
    scenario.setdefault("capacity", 200 * MiB)
    for rank in range(world_size):
        kwargs = dict(
            rank=rank, world_size=world_size, port=port, ckpt=str(ckpt), out_dir=str(out_dir), **scenario
        )
        procs.append(ctx.Process(target=tp_rank, args=(kwargs,), name=f"test-rank{rank}"))
    started = time.monotonic()
    for p in procs:
        p.start()
    exits: dict[int, float] = {}
    while len(exits) < world_size and time.monotonic() < started + deadline_s:
        for rank, p in enumerate(procs):
            if rank not in exits and not p.is_alive():
                exits[rank] = time.time()
        time.sleep(0.05)
    hung = [p.name for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    assert not hung, f"{hung} still running {deadline_s:g}s after start"
    results = {}
    for rank in range(world_size):
        f = out_dir / f"rank{rank}.json"
        results[rank] = json.loads(f.read_text()) if f.exists() else {"status": "no result"}
        results[rank]["exitcode"] = procs[rank].exitcode
    return results, exits, started
