"""The common start-up of every stage: phases in order, blocking steps off the event loop and
metered, the allocator capped at the budget less what the stage holds outside it, the memory report's
budget, SERVING last; a failing step fails the start in its phase; a TP group agrees through the
StageGroup hooks, and a failing rank leaves with the group's one diagnostic."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from omnistage.common import mps
from omnistage.common.config import config_from_dict
from omnistage.common.memory import ledger
from omnistage.common.runtime.boot import Boot, StageStartup, start_stage
from omnistage.common.runtime.progress import StageProgress
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_group import StageGroup
from omnistage.v1 import control_pb2

MiB = 1 << 20


def runtime(tmp_path, **svc) -> ServiceRuntime:
    memory = {"simulated_capacity_bytes": 64 * MiB, "budget_bytes": 32 * MiB}
    cfg = config_from_dict({"services": {"enc": {"kind": "encoder", "port": 1, "memory": memory, **svc}}})
    return ServiceRuntime(cfg, cfg.service("enc"), 0, run_dir=tmp_path, port=0)


class Recorded(StageStartup):
    """A stage that records what each step saw."""

    warm_up_detail = "one request"
    outside = 4 * MiB
    fail_in = ""

    def __init__(self, boot: Boot) -> None:
        super().__init__(boot)
        self.seen: list[tuple] = []

    def _step(self, name: str) -> None:
        before = self.boot.mem.allocated()
        made = torch.empty(MiB, dtype=torch.uint8)
        metered = self.boot.mem.allocated() - before >= MiB
        del made
        self.seen.append(
            (
                name,
                self.boot.runtime.phase,
                threading.current_thread().name,
                torch.is_inference_mode_enabled(),
                metered,
            )
        )
        if self.fail_in == name:
            raise RuntimeError(f"{name} broke")

    def outside_allocator_bytes(self) -> int:
        return self.outside

    def load(self) -> None:
        self.boot.progress.shards(1, 2)
        self._step("load")

    def stress(self) -> None:
        self.boot.progress.in_phase("profiling_memory", "batch 4")
        self._step("stress")

    async def warm_up(self) -> None:
        self._step("warm_up")

    def serve(self) -> None:
        self._step("serve")

    def memory_report(self) -> control_pb2.MemoryReport:
        return control_pb2.MemoryReport(
            device="sim", budget_bytes=self.boot.allocator_budget, weights_bytes=7
        )


def phases_of(rt: ServiceRuntime) -> list[tuple[str, str, str]]:
    """(phase, unit, detail) as each phase is entered."""
    seen: list[tuple[str, str, str]] = []

    def on_change(snap) -> None:
        if not seen or seen[-1][0] != snap.phase:
            seen.append((snap.phase, snap.unit, snap.detail))

    rt.reporter.add_listener(on_change)
    return seen


def test_the_device_of_a_rank_is_one_rule_on_the_service_config():
    """The boot, the memory ledger and the MPS plan read the same rank → GPU rule."""
    cfg = config_from_dict(
        {
            "services": {
                "c": {"kind": "encoder", "port": 1},
                "g": {"kind": "encoder", "port": 2, "device": "cuda", "gpus": [3]},
                "t": {"kind": "thinker", "port": 3, "device": "cuda", "tp_size": 2, "dist_port": 9000},
                "u": {
                    "kind": "thinker",
                    "port": 5,
                    "device": "cuda",
                    "tp_size": 2,
                    "dist_port": 9100,
                    "gpus": [3, 1],
                },
            }
        }
    )
    assert cfg.service("c").device_of(0) == "cpu"
    assert cfg.service("g").device_of(0) == "cuda:3"
    assert [cfg.service("t").device_of(r) for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert [cfg.service("u").device_of(r) for r in (0, 1)] == ["cuda:3", "cuda:1"]
    assert [ledger.ledger_device(cfg.service("u"), r) for r in (0, 1)] == ["cuda:3", "cuda:1"]
    assert mps.shared_gpus(cfg) == {1: ["t r1", "u r1"], 3: ["g r0", "u r0"]}


def test_the_phases_come_in_order_and_the_blocking_steps_run_metered_off_the_loop(tmp_path):
    rt = runtime(tmp_path)
    phases = phases_of(rt)
    stage = Recorded(Boot.resolve(rt, rt.cfg, rt.svc, 0))
    asyncio.run(start_stage(stage))
    assert [p for p, _, _ in phases] == [
        "starting",
        "loading_weights",
        "profiling_memory",
        "warming_up",
        "serving",
    ]
    assert phases[1][1] == "shards" and phases[2][1] == "attempts" and phases[3][2] == "one request"
    loop_thread = threading.current_thread().name
    assert [s[:2] for s in stage.seen] == [
        ("load", "loading_weights"),
        ("stress", "profiling_memory"),
        ("warm_up", "warming_up"),
        ("serve", "warming_up"),
    ]
    assert {s[2] for s in stage.seen[:2]} == {"encoder-startup"}
    assert {s[2] for s in stage.seen[2:]} == {loop_thread}
    assert [s[4] for s in stage.seen] == [True, True, False, False]  # load and stress inside mem.meter()
    assert not any(s[3] for s in stage.seen)  # no inference_mode unless the stage asks


def test_the_allocator_gets_the_budget_less_the_memory_held_outside_it_and_the_report_the_whole_budget(
    tmp_path,
):
    rt = runtime(tmp_path)
    boot = Boot.resolve(rt, rt.cfg, rt.svc, 0)
    asyncio.run(start_stage(Recorded(boot)))
    assert boot.budget == 32 * MiB and boot.allocator_budget == 28 * MiB
    assert boot.mem.limit == 28 * MiB
    (report,) = rt.memory_provider()
    assert report.budget_bytes == 32 * MiB and report.weights_bytes == 7


def test_without_a_budget_the_allocator_is_not_limited(tmp_path):
    rt = runtime(tmp_path, memory={"simulated_capacity_bytes": 64 * MiB})
    boot = Boot.resolve(rt, rt.cfg, rt.svc, 0)
    asyncio.run(start_stage(Recorded(boot)))
    assert boot.allocator_budget == 0 and rt.memory_provider()[0].budget_bytes == 0


def test_inference_mode_covers_load_and_stress_when_the_stage_asks(tmp_path):
    class Inference(Recorded):
        inference_mode = True

    rt = runtime(tmp_path)
    stage = Inference(Boot.resolve(rt, rt.cfg, rt.svc, 0))
    asyncio.run(start_stage(stage))
    assert [s[3] for s in stage.seen] == [True, True, False, False]


@pytest.mark.parametrize(
    "step, phase", [("load", "loading_weights"), ("stress", "profiling_memory"), ("warm_up", "warming_up")]
)
def test_a_failing_step_fails_the_start_in_its_phase_and_never_serves(tmp_path, step, phase):
    class Broken(Recorded):
        fail_in = step

    rt = runtime(tmp_path)
    with pytest.raises(RuntimeError, match=f"{step} broke"):
        asyncio.run(start_stage(Broken(Boot.resolve(rt, rt.cfg, rt.svc, 0))))
    assert rt.phase == phase and rt.memory_provider is None


def test_progress_counts_shards_and_a_stress_reports_in_its_phase(tmp_path):
    rt = runtime(tmp_path)
    progress = StageProgress(rt)
    progress.enter("loading_weights", unit="shards")
    progress.shards(2, 5)
    snap = rt.reporter.snapshot()
    assert (snap.done, snap.total, snap.detail) == (2, 5, "2/5 shards")
    progress.in_phase("profiling_memory", "batch 8")
    progress.in_phase("profiling_memory", "batch 4")  # same phase: a heartbeat, not a new phase
    snap = rt.reporter.snapshot()
    assert (snap.phase, snap.detail) == ("profiling_memory", "batch 4")
    progress.step("probe", 1, 3)
    assert (rt.reporter.snapshot().done, rt.reporter.snapshot().total) == (1, 3)


class RecordingGroup(StageGroup):
    """A group whose hooks record when the boot calls them (the phase the reporter is in, the thread)."""

    def __init__(self, rt: ServiceRuntime) -> None:
        self.rt = rt
        self.calls: list[tuple[str, str, str]] = []

    def _seen(self, what: str) -> None:
        self.calls.append((what, self.rt.phase, threading.current_thread().name))

    def join(self) -> None:
        self._seen("join")

    def enter(self, phase: str) -> None:
        self._seen(f"enter {phase}")

    def started(self) -> None:
        self._seen("started")

    def failure(self, exc: Exception) -> Exception:
        self._seen("failure")
        return RuntimeError(f"the group's diagnostic: rank 1 failed in {self.rt.phase}: {exc}")


class InGroup(Recorded):
    def __init__(self, boot: Boot) -> None:
        super().__init__(boot)
        self.group = RecordingGroup(boot.runtime)

    async def warm_up_request(self) -> None:
        self._step("warm_up_request")

    async def run(self) -> None:
        self._step("run")


def test_a_group_joins_before_loading_hears_each_phase_first_and_agrees_before_the_warm_up_request(tmp_path):
    rt = runtime(tmp_path)
    stage = InGroup(Boot.resolve(rt, rt.cfg, rt.svc, 0))
    asyncio.run(start_stage(stage))
    calls = stage.group.calls
    # Each phase reaches the group before the reporter (whose fault hook may fire in it).
    assert [(w, p) for w, p, _ in calls] == [
        ("enter loading_weights", "starting"),
        ("join", "loading_weights"),
        ("enter profiling_memory", "loading_weights"),
        ("enter warming_up", "profiling_memory"),
        ("started", "warming_up"),
    ]
    assert calls[1][2] == "encoder-startup"  # the rendezvous blocks: off the event loop, before the load
    assert [s[0] for s in stage.seen] == ["load", "stress", "warm_up", "warm_up_request", "serve", "run"]
    assert [s[1] for s in stage.seen][3:] == ["warming_up", "warming_up", "serving"]


@pytest.mark.parametrize("step", ["load", "warm_up", "warm_up_request"])
def test_a_failing_rank_of_a_group_leaves_with_the_groups_diagnostic(tmp_path, step):
    class Broken(InGroup):
        fail_in = step

    rt = runtime(tmp_path)
    stage = Broken(Boot.resolve(rt, rt.cfg, rt.svc, 0))
    with pytest.raises(RuntimeError, match=f"^the group's diagnostic: rank 1 failed in .*: {step} broke$"):
        asyncio.run(start_stage(stage))
    assert stage.group.calls[-1][0] == "failure" and "run" not in [s[0] for s in stage.seen]
    assert rt.memory_provider is None
