"""PhaseReporter: phases, progress, terminal states, listeners, the status file, and the fault hook."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
from omnistage.common.config import FaultConfig
from omnistage.common.runtime.errors import SimulatedOOM
from omnistage.common.runtime.phases import PHASES, PhaseReporter, phase_to_proto
from omnistage.common.runtime.status_file import read_status, status_path
from omnistage.v1 import control_pb2

from tests.waits import wait_for


def test_phase_names_match_the_proto_enum():
    proto_names = [n for n in control_pb2.Phase.keys() if n != "PHASE_UNSPECIFIED"]
    assert [f"PHASE_{p.upper()}" for p in PHASES] == proto_names
    for p in PHASES:
        assert control_pb2.Phase.Name(phase_to_proto(p)) == f"PHASE_{p.upper()}"


def test_progress_and_status_file(tmp_path):
    path = status_path(tmp_path, "thinker", 1)
    r = PhaseReporter("thinker", 1, status_file=path, address="")
    assert read_status(path).phase == "starting"
    r.enter("loading_weights", total=3, unit="shards")
    r.advance()
    r.advance(detail="model-00002-of-00003.safetensors")
    rec = read_status(path)
    assert (rec.service, rec.rank, rec.pid) == ("thinker", 1, os.getpid())
    assert (rec.phase, rec.done, rec.total, rec.unit) == ("loading_weights", 2, 3, "shards")
    assert rec.progress_text() == "2/3 shards (model-00002-of-00003.safetensors)"
    assert rec.heartbeat_unix >= rec.phase_started_unix
    proto = r.to_proto()
    assert (proto.phase, proto.done, proto.total) == (control_pb2.PHASE_LOADING_WEIGHTS, 2, 3)
    r.enter("profiling_memory")
    assert (r.snapshot().done, r.snapshot().total) == (0, 0)


def test_failed_is_terminal_and_keeps_the_phase_it_failed_in(tmp_path):
    path = status_path(tmp_path, "encoder", 0)
    r = PhaseReporter("encoder", 0, status_file=path)
    r.enter("warming_up", total=4, unit="batches")
    r.advance()
    r.fail("CUDA error: device lost")
    r.enter("serving")
    r.enter("stopped")
    rec = read_status(path)
    assert (rec.phase, rec.failed_in, rec.failure, rec.done) == (
        "failed",
        "warming_up",
        "CUDA error: device lost",
        1,
    )


def test_stopped_only_turns_into_failed():
    r = PhaseReporter("gateway")
    r.enter("stopped")
    r.enter("serving")
    assert r.phase == "stopped"
    r.fail("late failure")
    assert r.phase == "failed"


def test_unknown_phase_is_rejected():
    with pytest.raises(ValueError, match="unknown phase 'loading'"):
        PhaseReporter("x").enter("loading")


def test_listeners_see_every_change_and_a_failing_listener_is_contained():
    seen = []
    r = PhaseReporter("talker")
    r.add_listener(lambda s: seen.append((s.phase, s.done)))
    r.add_listener(lambda s: 1 / 0)
    r.enter("capturing_graphs", total=2, unit="graphs")
    r.advance()
    assert seen == [("starting", 0), ("capturing_graphs", 0), ("capturing_graphs", 1)]


def test_progress_from_threads_is_counted_exactly(tmp_path):
    r = PhaseReporter("thinker", status_file=status_path(tmp_path, "thinker", 0))
    r.enter("loading_weights", total=400, unit="tensors")
    threads = [threading.Thread(target=lambda: [r.advance() for _ in range(100)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert r.snapshot().done == 400
    assert read_status(status_path(tmp_path, "thinker", 0)).done == 400


def test_fault_oom_only_on_its_phase_and_rank():
    fault = FaultConfig(phase="profiling_memory", action="oom", rank=1)
    PhaseReporter("thinker", 0, fault=fault).enter("profiling_memory")  # other rank: nothing happens
    r = PhaseReporter("thinker", 1, fault=fault)
    r.enter("loading_weights")
    with pytest.raises(SimulatedOOM, match="profiling_memory"):
        r.enter("profiling_memory")
    assert isinstance(SimulatedOOM("x"), MemoryError)


def test_fault_delay_goes_on(tmp_path):
    r = PhaseReporter("thinker", fault=FaultConfig(phase="warming_up", action="delay", delay_s=0.01))
    r.enter("warming_up")
    r.advance()
    assert r.phase == "warming_up" and r.snapshot().done == 1


def _run_fault(action: str, tmp_path, timeout: float) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        from omnistage.common.config import FaultConfig
        from omnistage.common.runtime.phases import PhaseReporter
        from omnistage.common.runtime.status_file import status_path
        r = PhaseReporter("thinker", 0, fault=FaultConfig(phase="loading_weights", action="{action}"),
                          status_file=status_path({str(tmp_path)!r}, "thinker", 0))
        r.enter("loading_weights", total=3, unit="shards")
        print("after fault", flush=True)
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_fault_crash_exits_with_code_3(tmp_path):
    proc = _run_fault("crash", tmp_path, 30)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "after fault" not in out
    assert read_status(status_path(tmp_path, "thinker", 0)).phase == "loading_weights"


def test_fault_hang_blocks_without_progress(tmp_path):
    proc = _run_fault("hang", tmp_path, 30)
    try:
        # The phase is written before the hook fires: once it is there, the process hangs in it.
        path = status_path(tmp_path, "thinker", 0)
        rec = wait_for(
            lambda: (r := read_status(path)) is not None and r.phase == "loading_weights" and r,
            60,
            "the status file in loading_weights",
        )
        with pytest.raises(subprocess.TimeoutExpired):
            proc.communicate(timeout=1.0)
        assert (rec.phase, rec.done) == ("loading_weights", 0)
        assert read_status(path) == rec  # no progress since
    finally:
        proc.kill()
        proc.wait(timeout=10)
