"""Helpers of the KV auto-profile and warm-up tests: a metered tiny thinker, an allocation recorder,
and a TP rank body for spawned processes that writes its outcome to a file."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import torch
from omnistage.common.config import EngineConfig, MemoryConfig
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.thinker.engine import model_runner
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.distributed import TPGroup
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.models.loader import load_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MiB = 1 << 20
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


def tp_rank(kwargs: dict) -> None:
    """Body of one spawned TP rank: start-up (load, profile, warm-up) with a simulated device, then
    write {"status", "message", "blocks"} to `out_dir/rank{r}.json`. A peer's failure seen by the
    watchdog is written the same way before the process exits."""
    from omnistage.common.log import setup_logging
    from omnistage.services.thinker.engine.distributed import init_tp_group
    from omnistage.services.thinker.engine.warmup import OOMInjection

    rank, out = kwargs["rank"], Path(kwargs["out_dir"]) / f"rank{kwargs['rank']}.json"
    setup_logging("thinker", rank=rank)

    lock, written = threading.Lock(), [False]  # main thread and watchdog may both fail: the first writes

    def write(status: str, message: str, **extra: Any) -> None:
        with lock:
            if not written[0]:
                tmp = out.with_suffix(".tmp")
                tmp.write_text(json.dumps({"status": status, "message": message, **extra}))
                tmp.rename(out)
                written[0] = True

    def on_peer_failure(diagnostic: str) -> None:
        write("peer_failed", diagnostic)
        os._exit(1)

    capacity = kwargs["capacity"]
    mem = SimulatedDeviceMemory(capacity)
    if kwargs.get("peer_bytes", {}).get(str(rank)):
        mem.reserve(kwargs["peer_bytes"][str(rank)], "peer stage")
    model_runner.device_memory_for = lambda device, simulated=None: mem
    group: TPGroup = init_tp_group(rank, 2, port=kwargs["port"], timeout_s=60, idle_timeout_s=60)
    inject = OOMInjection(kwargs["inject_rank"]) if kwargs.get("inject_rank") is not None else None
    try:
        with group.failure_watch(on_peer_failure):
            runner = ModelRunner.from_checkpoint(
                kwargs["ckpt"], CFG, "float32", "cpu", group,
                memory=MemoryConfig(simulated_capacity_bytes=capacity), inject=inject,
            )  # fmt: skip
    except Exception as exc:
        if not group.reported:
            group.fail("start-up", exc)
        write("error", f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    prof = runner.kv_profile
    write("ok", "", blocks=runner.num_kv_blocks, proposed=prof.proposed_blocks, cap=prof.cap_bytes)
