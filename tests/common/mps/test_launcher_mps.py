"""The launcher owns CUDA MPS where stages share a GPU: a stand-in control program (no GPU) shows the
daemon started before the stages, handed to them, stopped after them on every exit path — and the
refusal under `on`, the fallback under `auto`, nothing under `off` or without a shared GPU."""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import pytest
from omnistage.common import mps
from omnistage.common.config import load_config
from omnistage.common.launcher import launch

from tests.common.runtime.synthetic_stage import SCRIPT, write_config
from tests.common.test_launcher import Run, alive
from tests.waits import wait_for

FAKE = str(Path(__file__).with_name("fake_mps_control.py"))
SHARED = {
    "alpha": {"device": "cuda", "gpus": [0]},
    "beta": {
        "kind": "talker",
        "device": "cuda",
        "gpus": [0],
        "mps_active_thread_percentage": 30,
        "mps_client_priority": "below_normal",
    },
}
MODULES = {"thinker": SCRIPT, "talker": SCRIPT}


def devices(mode: str, **extra) -> dict:
    return {"mps": {"mode": mode, "control_binary": FAKE, "stop_timeout_s": 3, **extra}}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def daemon_pid(out: str) -> int:
    line = next(x for x in out.splitlines() if "CUDA MPS control daemon started" in x)
    return int(line.split("(pid ", 1)[1].split(",", 1)[0])


def control_log(pid: int) -> str:
    """The stand-in daemon's log, found through its environment while it runs."""
    return (Path(environ(pid)[mps.LOG_ENV]) / "control.log").read_text()


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for run in started:
        run.kill()
        pids = list(run.child_pids().values())
        if "CUDA MPS control daemon started" in run.out:
            pids.append(daemon_pid(run.out))
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_which_gpus_are_shared_decides_auto(tmp_path):
    cfg = load_config(write_config(tmp_path / "shared.yaml", SHARED))
    assert mps.shared_gpus(cfg) == {0: ["alpha r0", "beta r0"]} and mps.wanted(cfg)
    apart = {"alpha": {"device": "cuda", "gpus": [0]}, "beta": {"device": "cuda", "gpus": [1]}}
    cfg = load_config(write_config(tmp_path / "apart.yaml", apart))
    assert mps.shared_gpus(cfg) == {} and not mps.wanted(cfg)  # auto: no shared GPU, no daemon
    cfg = load_config(write_config(tmp_path / "on.yaml", apart, devices={"mps": {"mode": "on"}}))
    assert mps.wanted(cfg)
    cfg = load_config(write_config(tmp_path / "off.yaml", SHARED, devices={"mps": {"mode": "off"}}))
    assert not mps.wanted(cfg)


def test_the_daemon_starts_before_the_stages_reaches_them_and_stops_after_them(tmp_path, runs):
    run = Run(tmp_path, SHARED, devices=devices("auto"))
    runs.append(run)
    run.wait_ready()
    pid, pids = daemon_pid(run.out), run.child_pids()
    pipe = environ(pid)[mps.PIPE_ENV]
    alpha, beta = environ(pids["alpha r0"]), environ(pids["beta r0"])
    assert alpha[mps.PIPE_ENV] == beta[mps.PIPE_ENV] == pipe  # both stages are the daemon's clients
    assert mps.THREAD_PERCENTAGE_ENV not in alpha and beta[mps.THREAD_PERCENTAGE_ENV] == "30"
    assert alpha[mps.PRIORITY_ENV] == "0" and beta[mps.PRIORITY_ENV] == "1"  # the talker yields
    log_dir = Path(environ(pid)[mps.LOG_ENV])
    assert log_dir.is_relative_to(tmp_path / "run")  # under the run dir, nothing host-wide
    # (pytest's run dir is too long for a socket path: the pipe has a temp dir of its own)
    assert Path(pipe).is_relative_to(tmp_path / "run") or Path(pipe).parent.name.startswith("omnistage-mps-")
    out = run.out
    assert out.index("CUDA MPS control daemon started") < out.index("omnistage: started alpha r0")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait_exit() == 0
    out = run.out
    assert out.index("all services stopped") < out.index("CUDA MPS control daemon stopped")
    assert not alive(pid) and not any(alive(p) for p in pids.values())
    assert not Path(pipe).exists()  # nothing left behind
    assert (log_dir / "control.log").read_text().rstrip().endswith("quit")  # stopped by `quit`


def test_a_daemon_that_ignores_quit_is_killed_and_said_so(tmp_path, runs):
    run = Run(tmp_path, SHARED, devices=devices("on"), env={"FAKE_MPS_IGNORE_QUIT": "1"})
    runs.append(run)
    run.wait_ready()
    pid = daemon_pid(run.out)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait_exit() == 0
    assert "CUDA MPS control daemon: it did not quit within 3s: killed" in run.err
    assert not alive(pid)


def test_the_daemon_dies_with_a_sigkilled_launcher(tmp_path, runs):
    run = Run(tmp_path, SHARED, devices=devices("auto"))
    runs.append(run)
    run.wait_ready()
    pid = daemon_pid(run.out)
    run.proc.kill()
    run.proc.wait(timeout=10)
    wait_for(lambda: not alive(pid), 20, "the MPS daemon to exit after its launcher")


def test_on_refuses_to_start_when_the_daemon_cannot(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    cfg = write_config(tmp_path / "deploy.yaml", SHARED, devices=devices("on"))
    out, err = io.StringIO(), io.StringIO()
    assert launch(cfg, [], modules=MODULES, exit_after_ready=True, out=out, err=err) == 1
    assert "CUDA MPS (devices.mps.mode: on) did not start" in err.getvalue()
    assert "exited with code 1" in err.getvalue() and "cannot start the daemon" in err.getvalue()
    assert "omnistage: started" not in out.getvalue()  # no stage was started


def test_on_names_a_missing_control_program(tmp_path):
    cfg = write_config(
        tmp_path / "deploy.yaml", SHARED, devices=devices("on", control_binary="no-such-mps-control")
    )
    err = io.StringIO()
    assert launch(cfg, [], modules=MODULES, exit_after_ready=True, out=io.StringIO(), err=err) == 1
    assert "'no-such-mps-control' not found on PATH" in err.getvalue()


def test_auto_falls_back_to_time_slicing_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    cfg = write_config(tmp_path / "deploy.yaml", SHARED, devices=devices("auto"))
    out, err = io.StringIO(), io.StringIO()
    assert launch(cfg, [], modules=MODULES, exit_after_ready=True, out=out, err=err) == 0, err.getvalue()
    assert "warning: CUDA MPS did not start, the stages that share a GPU will time-slice it" in err.getvalue()
    assert "ready in" in out.getvalue() and "daemon started" not in out.getvalue()


def test_off_and_unshared_gpus_start_no_daemon(tmp_path):
    for name, services, mode in (("off", SHARED, "off"), ("apart", {"alpha": {"device": "cuda"}}, "auto")):
        cfg = write_config(tmp_path / f"{name}.yaml", services, devices=devices(mode))
        out = io.StringIO()
        assert launch(cfg, [], modules=MODULES, exit_after_ready=True, out=out, err=io.StringIO()) == 0
        assert "MPS" not in out.getvalue()
