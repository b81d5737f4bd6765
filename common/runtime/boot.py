"""The one start-up path of every stage (encoder, talker, image-gen, each thinker rank), driven by its
`StageStartup`; the ranks of a TP group agree on its steps through the stage's `StageGroup` hooks."""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NoReturn

import torch
from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.memory.device import DeviceMemory, device_memory_for
from omnistage.common.memory.report import export_memory
from omnistage.common.runtime.blocking import in_daemon_thread
from omnistage.common.runtime.cpu_share import share_cpu_cores
from omnistage.common.runtime.progress import StageProgress
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_group import StageGroup
from omnistage.common.runtime.stage_main import run_service
from omnistage.v1 import control_pb2


@dataclass
class Boot:
    """What every stage's start-up resolves the same way: where it runs, its memory and budget, progress."""

    runtime: ServiceRuntime
    cfg: DeployConfig
    svc: ServiceConfig
    rank: int
    device: str
    mem: DeviceMemory
    # The service's budget on its device in bytes (0: none): what its memory report says.
    budget: int
    progress: StageProgress
    # What torch's allocator may hold (the budget less memory held outside it); 0: no limit.
    allocator_budget: int = 0

    @classmethod
    def resolve(cls, runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int = 0) -> Boot:
        device = svc.device_of(rank)
        mem = device_memory_for(device, svc.memory.simulated_capacity_bytes or None)
        budget = svc.memory.budget_of(mem.total())
        return cls(runtime, cfg, svc, rank, device, mem, budget, StageProgress(runtime), budget)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.svc.dtype)

    @property
    def checkpoint(self) -> str:
        return self.cfg.model.checkpoint

    @property
    def dummy_weights(self) -> bool:
        """`model.load_format: dummy`: random weights in the real shapes, made on the device."""
        return self.cfg.model.load_format == "dummy"

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def full_warmup(self) -> bool:
        """Every warm-up shape and stress batch (an accelerator, a simulated device, or `startup.cpu_warmup:
        full`); else each path once (`StartupConfig.full_warmup` says why)."""
        return self.cfg.startup.full_warmup(self.device, self.svc.memory.simulated_capacity_bytes)

    def limit_allocator(self, outside_bytes: int) -> None:
        """Cap torch's allocator at the budget less `outside_bytes` held outside it (a CUDA IPC pool)."""
        self.allocator_budget = max(self.budget - outside_bytes, 1) if self.budget else 0
        if self.allocator_budget and hasattr(self.mem, "set_limit"):
            self.mem.set_limit(self.allocator_budget)


class StageStartup(abc.ABC):
    """One stage's own start-up steps; `start_stage` runs them in order inside the common phases.

    `load` and `stress` run in one daemon thread inside `meter()` (they block); the rest runs on the
    event loop. State passes between the steps as attributes of the subclass. The ranks of a TP group
    agree through `group` (a rank alone by default).
    """

    # The `warming_up` phase's detail: what the warm-up sends through the stage.
    warm_up_detail: ClassVar[str] = ""
    # Run `load` and `stress` under torch.inference_mode (tensors made there are inference tensors).
    inference_mode: ClassVar[bool] = False
    # Cap torch's allocator at the budget (False: the stage sizes itself within it, as the thinker's KV
    # auto-profile does).
    caps_allocator: ClassVar[bool] = True
    # What `loading_weights` and `warming_up` count (a stage may set them per instance).
    load_unit: str = "shards"
    warm_up_unit: str = ""

    def __init__(self, boot: Boot) -> None:
        self.boot = boot
        self.group = StageGroup()

    def enter(self, phase: str, *, unit: str = "", detail: str = "") -> None:
        """A start-up phase begins: the group hears of it first (a failure in it names it), then the
        reporter (whose fault hook may fire here)."""
        self.group.enter(phase)
        self.boot.progress.enter(phase, unit=unit, detail=detail)

    def meter(self) -> contextlib.AbstractContextManager[object]:
        """What `load` and `stress` run inside: the device accountant's meter."""
        return self.boot.mem.meter()

    def outside_allocator_bytes(self) -> int:
        """Device memory the stage will hold outside torch's allocator (asked before anything loads)."""
        return 0

    @abc.abstractmethod
    def load(self) -> None:
        """loading_weights: build the models on the device (report shards to `boot.progress.shards`)."""

    @abc.abstractmethod
    def stress(self) -> None:
        """profiling_memory: stress-and-cap within `boot.allocator_budget` (report to `boot.progress.in_phase`)."""

    @abc.abstractmethod
    async def warm_up(self) -> None:
        """warming_up: start the engine (its stop as a shutdown hook), then one real request through it."""

    async def warm_up_request(self) -> None:
        """After the group's last agreement: what needs every rank running (a real request through a TP
        engine); a single-device stage sends its request in `warm_up`."""
        return

    @abc.abstractmethod
    def serve(self) -> None:
        """Register the servicer and the limits, load and metrics providers."""

    @abc.abstractmethod
    def memory_report(self) -> control_pb2.MemoryReport:
        """The stage's device memory now (the budget is filled in by the boot)."""

    async def run(self) -> None:
        """After SERVING: a rank that serves through a loop of its own (a TP worker) runs it here, and
        stops the service when it ends; a stage served by its servicer returns at once."""
        return


async def start_stage(stage: StageStartup) -> None:
    """Run one stage's start-up through every phase to SERVING, then its `run`; any exception fails
    the start (in a group, with the group's one diagnostic)."""
    try:
        await _start(stage)
    except Exception as exc:
        failure = await in_daemon_thread(
            functools.partial(stage.group.failure, exc), f"{stage.boot.svc.kind}-failure"
        )
        if failure is exc:
            raise
        raise failure from exc
    await stage.run()


async def _start(stage: StageStartup) -> None:
    boot, group = stage.boot, stage.group
    if boot.on_cuda:
        torch.cuda.set_device(torch.device(boot.device))
    if stage.caps_allocator:
        boot.limit_allocator(stage.outside_allocator_bytes())

    def load_and_stress() -> None:
        group.join()
        with torch.inference_mode() if stage.inference_mode else contextlib.nullcontext(), stage.meter():
            stage.load()
            stage.enter("profiling_memory", unit="attempts")
            stage.stress()

    stage.enter("loading_weights", unit=stage.load_unit)
    await in_daemon_thread(load_and_stress, f"{boot.svc.kind}-startup")
    stage.enter("warming_up", unit=stage.warm_up_unit, detail=stage.warm_up_detail)
    await stage.warm_up()
    await in_daemon_thread(group.started, f"{boot.svc.kind}-startup")
    await stage.warm_up_request()
    stage.serve()

    def memory() -> list[control_pb2.MemoryReport]:
        report = stage.memory_report()
        if boot.budget:
            report.budget_bytes = boot.budget
        return [report]

    boot.runtime.set_memory_provider(memory)
    export_memory(boot.svc.name, boot.rank, memory()[0])
    boot.runtime.set_serving()


def run_stage(argv: Sequence[str], kind: str, startup: type[StageStartup]) -> NoReturn:
    """`main()` of a stage: `run_service` with the common start-up around `startup` (one per rank); a
    CPU stage first takes its share of the host's cores as torch threads (`cpu_share.py`)."""

    async def build(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> None:
        share_cpu_cores(cfg, svc)
        await start_stage(startup(Boot.resolve(runtime, cfg, svc, rank)))

    run_service(argv, kind, build)
