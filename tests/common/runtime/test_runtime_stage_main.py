"""run_service in a real process: SIGTERM drains within the grace period, failures exit non-zero."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from omnistage.common.runtime.status_file import read_status, status_path
from omnistage.v1 import omni_pb2, omni_pb2_grpc

from tests.common.runtime.synthetic_stage import SCRIPT, write_config
from tests.waits import wait_for


def start_stage(
    tmp_path, overrides=(), step_s: float = 0.02, env: dict | None = None, **svc
) -> subprocess.Popen:
    cfg = write_config(tmp_path / "deploy.yaml", {"alpha": svc})
    cmd = [
        sys.executable,
        SCRIPT,
        "--config",
        str(cfg),
        "--service",
        "alpha",
        "--rank",
        "0",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    for text in overrides:
        cmd += ["--set", text]
    env = dict(os.environ, SYNTH_STEP_S=str(step_s), **(env or {}))
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)


def wait_phase(tmp_path, phase: str, timeout_s: float = 30.0):
    path = status_path(tmp_path / "run", "alpha", 0)
    return wait_for(
        lambda: (rec := read_status(path)) is not None and rec.phase == phase and rec,
        timeout_s,
        f"alpha phase {phase}",
    )


class StreamReader(threading.Thread):
    """Reads one Generate stream in the background; `first` is set at the first event."""

    def __init__(self, address: str, text: str) -> None:
        super().__init__(daemon=True)
        self.address, self.text = address, text
        self.first = threading.Event()
        self.events: list = []
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=self.text)])
        with grpc.insecure_channel(self.address) as ch:
            try:
                for event in omni_pb2_grpc.OmniStub(ch).Generate(
                    omni_pb2.GenerateRequest(messages=[msg]), timeout=30
                ):
                    self.events.append(event)
                    self.first.set()
            except grpc.RpcError as exc:
                self.error = exc
        self.first.set()


def stop_and_wait(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
        pytest.fail(f"service did not stop within {timeout_s}s of SIGTERM")
    return proc.returncode, err


def test_sigterm_lets_a_short_stream_finish_then_exits_0(tmp_path):
    proc = start_stage(tmp_path, drain_grace_s=5.0)
    rec = wait_phase(tmp_path, "serving")
    reader = StreamReader(rec.address, "n=6 delay=0.1")
    reader.start()
    assert reader.first.wait(30)
    code, _ = stop_and_wait(proc, 15)
    reader.join(10)
    assert code == 0
    assert reader.error is None and reader.events[-1].WhichOneof("event") == "finish"
    assert read_status(status_path(tmp_path / "run", "alpha", 0)).phase == "stopped"


def test_sigterm_cancels_a_long_stream_after_the_grace_period(tmp_path):
    proc = start_stage(tmp_path, drain_grace_s=0.3)
    rec = wait_phase(tmp_path, "serving")
    reader = StreamReader(rec.address, "n=1000 delay=0.05")
    reader.start()
    assert reader.first.wait(30)
    code, _ = stop_and_wait(proc, 15)
    reader.join(10)
    assert code == 0
    assert reader.error is not None and reader.error.code() == grpc.StatusCode.CANCELLED


def test_failure_in_build_exits_1_with_one_diagnostic_line(tmp_path):
    proc = start_stage(tmp_path, fault={"phase": "warming_up", "action": "oom"})
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "omnistage: alpha r0 failed in warming_up: SimulatedOOM: simulated out of memory" in err
    rec = read_status(status_path(tmp_path / "run", "alpha", 0))
    assert (rec.phase, rec.failed_in) == ("failed", "warming_up") and "SimulatedOOM" in rec.failure


def test_config_error_exits_2_naming_the_key(tmp_path):
    proc = start_stage(tmp_path, overrides=["services.alpha.drain_grace_s=soon"])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "services.alpha.drain_grace_s: expected a number, got 'soon'" in err


def test_sigterm_during_start_up_stops_cleanly(tmp_path):
    proc = start_stage(tmp_path, step_s=5.0)  # loading_weights would take 15 s
    wait_phase(tmp_path, "loading_weights")
    code, _ = stop_and_wait(proc, 10)
    assert code == 0
    rec = read_status(status_path(tmp_path / "run", "alpha", 0))
    assert rec.phase == "stopped"


def test_a_failure_that_names_another_rank_is_recorded_as_that_ranks(tmp_path):
    """A TP rank leaving because rank 1 failed raises an error carrying `culprit_rank`; its status
    file must name rank 1 whatever else the rank reported, so the launcher blames rank 1 (it blamed
    the rank that happened to fail first through this path)."""
    import asyncio

    from omnistage.common.config import config_from_dict
    from omnistage.common.runtime.server import ServiceRuntime
    from omnistage.common.runtime.stage_main import serve

    from tests.common.runtime.synthetic_stage import free_port

    class PeersFailure(RuntimeError):
        culprit_rank = 1

    async def build(runtime, cfg, svc, rank):
        raise PeersFailure("rank 1 failed in warming_up: out of memory")

    cfg = config_from_dict(
        {
            "services": {
                "alpha": {"kind": "thinker", "port": free_port(), "tp_size": 2, "dist_port": free_port()}
            }
        }
    )
    runtime = ServiceRuntime(cfg, cfg.service("alpha"), 0, run_dir=tmp_path)
    assert asyncio.run(serve(runtime, build)) == 1
    rec = read_status(status_path(tmp_path, "alpha", 0))
    assert rec.phase == "failed" and rec.culprit_rank == 1, rec


def test_a_stop_in_the_middle_of_a_blocking_load_exits_0_not_sigabrt(tmp_path):
    """Finalizing the interpreter under a thread still running torch aborted the process (SIGABRT:
    "terminate called without an active exception"): the talker stopped while loading did this."""
    proc = start_stage(tmp_path, env={"SYNTH_TORCH_LOAD": "1"})
    path = status_path(tmp_path / "run", "alpha", 0)
    wait_for(
        lambda: (rec := read_status(path)) is not None and rec.detail == "torch running", 60, "torch at work"
    )
    code, err = stop_and_wait(proc, 30)
    assert code == 0, err
    assert "terminate called" not in err
