"""The launcher with synthetic stages: ready, stuck, crashed, killed, stopped — and nothing left behind."""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import load_config  # noqa: E402
from omnistage.common.launcher import launch  # noqa: E402

from tests.common.runtime.synthetic_stage import SCRIPT, free_port, write_config
from tests.waits import wait_for  # noqa: E402

DRIVER = f"""
import sys
from omnistage.common.launcher import launch
S = {SCRIPT!r}
sys.exit(launch(sys.argv[1], [], run_dir=sys.argv[2], ready_file=sys.argv[3], modules={{"thinker": S, "talker": S, "gateway": S}}))
"""


class Run:
    """A launcher process driving synthetic stages; its output goes to files readable at any time."""

    def __init__(
        self,
        tmp_path: Path,
        services: dict,
        step_s: float = 0.02,
        supervision: dict | None = None,
        env: dict | None = None,
        devices: dict | None = None,
        **startup,
    ) -> None:
        self.cfg = write_config(tmp_path / "deploy.yaml", services, supervision, devices, **startup)
        self.ready_file = tmp_path / "ready"
        self.out_path, self.err_path = tmp_path / "out.txt", tmp_path / "err.txt"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", DRIVER, str(self.cfg), str(tmp_path / "run"), str(self.ready_file)],
                stdout=out,
                stderr=err,
                env=dict(os.environ, SYNTH_STEP_S=str(step_s), **(env or {})),
            )

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def child_pids(self) -> dict[str, int]:
        """`alpha r0` → pid, from the launcher's `started ... (pid N)` lines."""
        pids = {}
        for line in self.out.splitlines():
            if line.startswith("omnistage: started "):
                label, pid = line.removeprefix("omnistage: started ").rsplit(" (pid ", 1)
                pids[label] = int(pid.rstrip(")"))
        return pids

    def wait_ready(self, timeout_s: float = 60) -> str:
        def ready():
            assert self.proc.poll() is None, f"launcher exited {self.proc.returncode}: {self.err}"
            return self.ready_file.exists() and self.ready_file.read_text().strip()

        return wait_for(ready, timeout_s, "launcher ready file")

    def wait_exit(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"launcher still running after {timeout_s}s\n{self.out}\n{self.err}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a non-reaping init counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_all_gone(pids, timeout_s: float = 20) -> None:
    wait_for(lambda: not any(alive(p) for p in pids), timeout_s, f"child pids {sorted(pids)} to exit")


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for run in started:  # a failed test must not leave processes behind either
        run.kill()
        for pid in run.child_pids().values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


TWO_SERVICES = {"alpha": {"tp_size": 2}, "front": {"kind": "gateway"}}


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_ready_drain_resume_then_sigterm_stops_every_child_and_exits_0(tmp_path, runs, capsys):
    """Start-up (ready waits for every capability the gateway serves text before), the launcher's
    drain and resume lines (with `status` showing the phase) and the stop, in one launch."""
    services = {
        "alpha": {"tp_size": 2, "admin_port": free_port()},
        "beta": {"admin_port": free_port()},
        "voice": {"kind": "talker", "admin_port": free_port()},
        "front": {"kind": "gateway", "admin_port": free_port()},
    }
    # step_s: slow enough for the 0.05 s polls to see each phase
    run = Run(tmp_path, services, step_s=0.15, env={"SYNTH_CAPABILITIES_AFTER_S": "2"})
    runs.append(run)
    address = run.wait_ready()
    pids = run.child_pids()
    assert set(pids) == {"alpha r0", "alpha r1", "beta r0", "voice r0", "front r0"}
    out = run.out
    waiting = out.index("front r0 serving text; waiting for speech")
    assert waiting < out.index("front r0 serving (") < out.index("omnistage: ready in")
    assert serving(address)
    assert address.endswith(f":{load_config(run.cfg).services['front'].port}")
    # Progress is shown as the launcher's polls see it (a loaded machine may poll past a short phase).
    shown = [
        p
        for p in ("starting", "loading_weights", "profiling_memory", "warming_up")
        if f"alpha r0 {p}" in run.out
    ]
    assert shown and "ready in" in run.out
    # Every service starts side by side, the gateway too: all run before any of them is SERVING.
    first_serving = min(run.out.index(f"{label} serving (") for label in ("alpha r0", "alpha r1", "beta r0"))
    assert run.out.index("started beta r0") < first_serving
    assert run.out.index("started front r0") < first_serving
    drain_and_resume(run, capsys)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait_exit() == 0
    assert "all services stopped" in run.out
    assert_all_gone(pids.values())


def drain_and_resume(run: Run, capsys) -> None:
    """`omnistage drain` / `resume` of the gateway: the launcher reports each, `status` shows the phase."""
    from omnistage.common.cli import main

    assert main(["drain", "--config", str(run.cfg), "--service", "front", "--deadline-ms", "500"]) == 0
    assert "front draining: 0 requests finished, 0 aborted" in capsys.readouterr().out
    wait_for(lambda: "front r0 draining (Control.Drain)" in run.out, 10, "launcher line for the drain")
    assert main(["status", "--config", str(run.cfg)]) == 1  # not every service is SERVING
    out = capsys.readouterr().out
    assert (
        "front (gateway) admin 127.0.0.1:" in out
        and "NOT_SERVING, phase draining" in out
        and "Control.Drain" in out
    )
    assert main(["resume", "--config", str(run.cfg), "--service", "front"]) == 0
    wait_for(lambda: "front r0 serving again (Control.Resume)" in run.out, 10, "launcher line for the resume")
    assert main(["status", "--config", str(run.cfg)]) == 0
    assert "SERVING, phase serving" in capsys.readouterr().out


def test_a_service_whose_clean_up_hangs_after_stopping_still_exits_on_sigterm(tmp_path, runs):
    """A clean-up that does not end (an exit handler stuck) must not keep a stopped service alive until
    the launcher's SIGKILL."""
    run = Run(tmp_path, {"alpha": {}}, env={"SYNTH_SLOW_EXIT": "1"})
    runs.append(run)
    run.wait_ready()
    pids = run.child_pids()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait_exit() == 0, run.err
    assert "ignored SIGTERM" not in run.err and "killed by" not in run.err, run.err
    assert "still running 1.0s after stopping (a clean-up that does not end): exiting" in run.err
    assert_all_gone(pids.values())


def test_a_capability_never_ready_fails_start_up_naming_it(tmp_path, runs):
    services = {
        "alpha": {},
        "voice": {"kind": "talker"},
        "front": {"kind": "gateway", "gateway": {"stage_wait_s": 1.5}},
    }
    run = Run(tmp_path, services, env={"SYNTH_CAPABILITIES_AFTER_S": "never"})
    runs.append(run)
    assert run.wait_exit() == 1
    assert (
        "start-up failed: front r0 stuck: serving, but speech not ready after 1.5s (gateway.stage_wait_s"
        in run.err
    )
    assert not run.ready_file.exists()
    assert_all_gone(run.child_pids().values())


def test_hang_in_a_phase_exits_nonzero_naming_stage_rank_and_phase(tmp_path, runs):
    services = {
        "alpha": {"tp_size": 2, "fault": {"phase": "loading_weights", "action": "hang", "rank": 1}},
        "front": {"kind": "gateway"},
    }
    run = Run(tmp_path, services, heartbeat_timeout_s=3.0, stop_grace_s=0.5)
    runs.append(run)
    assert run.wait_exit() == 1
    lines = run.err.splitlines()
    culprit = [line for line in lines if line.startswith("alpha r1 ")]
    assert (
        len(culprit) == 1
        and "loading_weights 0/3 shards" in culprit[0]
        and "stuck: no progress" in culprit[0]
    )
    assert any(line.startswith("omnistage: start-up failed: alpha r1 stuck") for line in lines)
    assert "omnistage: ready" not in run.out and not run.ready_file.exists()
    assert "ignored SIGTERM, killing" in run.err  # the hung rank needed SIGKILL
    assert_all_gone(run.child_pids().values())


def test_phase_deadline_is_enforced_while_progress_continues(tmp_path, runs):
    run = Run(tmp_path, {"alpha": {}}, step_s=0.5, phase_deadlines_s={"loading_weights": 0.6})
    runs.append(run)
    assert run.wait_exit() == 1
    assert "alpha r0 loading_weights" in run.err and "phase deadline 0.6s exceeded" in run.err
    assert_all_gone(run.child_pids().values())


def test_crash_exits_nonzero_at_once_naming_the_exit_code(tmp_path, runs):
    run = Run(tmp_path, {"alpha": {"fault": {"phase": "profiling_memory", "action": "crash"}}})
    runs.append(run)
    assert run.wait_exit() == 1
    culprit = [line for line in run.err.splitlines() if line.startswith("alpha r0 ")]
    assert len(culprit) == 1 and "profiling_memory" in culprit[0] and "exited with code 3" in culprit[0]
    assert_all_gone(run.child_pids().values())


def test_oom_in_a_phase_reports_the_failure(tmp_path, runs):
    run = Run(tmp_path, {"alpha": {"fault": {"phase": "warming_up", "action": "oom"}}})
    runs.append(run)
    assert run.wait_exit() == 1
    culprit = [line for line in run.err.splitlines() if line.startswith("alpha r0 ")]
    assert "warming_up" in culprit[0] and "SimulatedOOM" in culprit[0]


def test_child_killed_after_serving_without_restarts_stops_the_rest_and_exits_nonzero(tmp_path, runs):
    run = Run(tmp_path, TWO_SERVICES, supervision={"max_restarts": 0})
    runs.append(run)
    run.wait_ready()
    pids = run.child_pids()
    os.kill(pids["alpha r1"], signal.SIGKILL)
    assert run.wait_exit() == 1
    assert "omnistage: alpha r1 died: killed by SIGKILL" in run.err
    assert any(line.startswith("alpha r1 serving") and "SIGKILL" in line for line in run.err.splitlines())
    assert_all_gone(pids.values())


FAST_SUPERVISION = {
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 2.0,
    "health_interval_s": 0.3,
    "backoff_initial_s": 0.2,
    "max_restarts": 3,
}


def test_hung_killed_and_crashed_services_are_restarted_and_serve_again_once_the_gateway_admits_them(
    tmp_path, runs
):
    """Every restart path in one launch (each would start the same processes): a hung TP rank
    (silent past its heartbeat timeout) and a killed one each restart their group as a whole, its old
    segments swept at the restart, and count as serving again only once the gateway re-admitted the
    stage; a crashed gateway is restarted too."""
    env = {"SYNTH_SHM": "1", "SYNTH_GATEWAY_WATCH": "alpha:3"}
    run = Run(tmp_path, TWO_SERVICES, supervision=FAST_SUPERVISION, env=env)
    runs.append(run)
    address = run.wait_ready()
    first = run.child_pids()
    assert len(segments_of([first["alpha r0"]])) == 1
    second = restart_alpha(run, address, first, 1, "alpha r1", signal.SIGSTOP)  # hung: alive, silent
    line = next(x for x in run.err.splitlines() if x.startswith("omnistage: alpha r1 stopped answering for "))
    silent_s = float(line.split(" for ")[1].split("s ")[0])
    # declared silent only once its 2 s heartbeat timeout passed (the wait above bounds when)
    assert silent_s >= 2.0, line
    assert line.endswith("(heartbeat timeout 2s) while serving; restarting alpha (attempt 1/3, in 0.2s)")
    assert serving(load_config(run.cfg).address("alpha"))

    third = restart_alpha(run, address, second, 2, "alpha r0", signal.SIGKILL)  # the group goes too
    assert "omnistage: alpha r0 died: killed by SIGKILL" in run.err

    os.kill(third["front r0"], signal.SIGKILL)  # the gateway crashing is restarted too
    wait_for(
        lambda: "omnistage: front serving again (restart 1/3)" in run.out, 60, "front restarted\n" + run.err
    )
    assert (
        "omnistage: front r0 died: killed by SIGKILL" in run.err
        and "restarting front (attempt 1/3" in run.err
    )
    assert serving(address)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait_exit() == 0
    every = [*first.values(), *second.values(), *third.values(), *run.child_pids().values()]
    assert_all_gone(every)
    assert segments_of(every) == []


def restart_alpha(
    run: Run, address: str, before: dict[str, int], n: int, victim: str, sig: signal.Signals
) -> dict[str, int]:
    """Sends `sig` to `victim` and checks alpha's `n`-th restart: the whole group replaced, the
    gateway kept, the old group's segments swept at the restart (not at exit), and the gateway's
    re-admission of alpha seen before the launcher says serving again. The pids after it."""
    admitted = run.out.count("synthetic gateway: admitted alpha")
    os.kill(before[victim], sig)
    again = f"omnistage: alpha serving again (restart {n}/3)"
    wait_for(lambda: again in run.out, 60, f"alpha restarted ({n})\n" + run.err)
    assert serving_capability(address, "text")  # the gateway serves text again: it admitted alpha
    out = run.out
    readmission = out.index(
        "synthetic gateway: admitted alpha", nth_end(out, "synthetic gateway: admitted alpha", admitted)
    )
    assert readmission < out.index(again)
    after = run.child_pids()
    assert after["alpha r0"] != before["alpha r0"] and after["alpha r1"] != before["alpha r1"]  # the group
    assert after["front r0"] == before["front r0"]
    assert not alive(before["alpha r0"]) and not alive(before["alpha r1"])
    # (the launcher says "removed 2 shared-memory segment(s) that alpha r0, alpha r1 left", unless
    # another launcher's start-up sweep on this host was quicker)
    assert segments_of([before["alpha r0"], before["alpha r1"]]) == []
    assert len(segments_of([after["alpha r0"], after["alpha r1"], after["front r0"]])) == 3
    return after


def nth_end(text: str, part: str, n: int) -> int:
    """Where the `n`-th occurrence of `part` in `text` ends (0 for n == 0)."""
    end = 0
    for _ in range(n):
        end = text.index(part, end) + len(part)
    return end


def serving_capability(address: str, capability: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=f"omnistage.v1.Omni.{capability}"), timeout=5
        )
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_restarts_exhausted_stop_everything_and_exit_1(tmp_path, runs):
    supervision = {**FAST_SUPERVISION, "max_restarts": 2, "backoff_initial_s": 0.1}
    run = Run(tmp_path, {"alpha": {}}, supervision=supervision, env={"SYNTH_CRASH_AFTER": "alpha:2.0"})
    runs.append(run)
    assert run.wait_exit(90) == 1
    assert "restarting alpha (attempt 2/2, in 0.2s)" in run.err
    assert "restarting alpha (attempt 1/2, in 0.1s)" in run.err  # crashed after ready: not a failed start
    # (a restart may crash before the launcher saw it ready: "died while restarting" then)
    assert "exited with code 5; restarts exhausted (2 within 600s), stopping the others" in run.err
    assert "all services stopped" in run.out
    assert_all_gone(run.child_pids().values())


def segments_of(pids) -> list[str]:
    """The /dev/shm segments owned by any of `pids`."""
    from omnistage.common.transport.host import SHM_DIR, segment_owner_pid

    return sorted(n for n in os.listdir(SHM_DIR) if segment_owner_pid(n) in set(pids))


def test_children_exit_when_the_launcher_is_sigkilled(tmp_path, runs):
    run = Run(tmp_path, TWO_SERVICES, env={"SYNTH_SHM": "1"})
    runs.append(run)
    run.wait_ready()
    pids = run.child_pids()
    assert len(segments_of(pids.values())) == 3
    run.proc.kill()
    run.proc.wait(timeout=10)
    assert_all_gone(pids.values())
    assert segments_of(pids.values()) == [], f"the orphans' shared memory outlived them\n{run.err}"


def test_a_child_stuck_in_start_up_exits_with_a_sigkilled_launcher_leaving_no_shm(tmp_path, runs):
    """A load that never ends (torch in a blocking thread) and a segment no graceful stop closes: the
    child still goes, and its segment with it, though nobody is left to sweep. One rank: each process
    watches its launcher itself (common/runtime/orphan.py), a second rank would import torch again to
    show the same."""
    run = Run(
        tmp_path,
        {"alpha": {}},
        env={"SYNTH_SHM": "1", "SYNTH_TORCH_LOAD": "1"},
        phase_deadlines_s={"loading_weights": 300.0},
        heartbeat_timeout_s=300.0,  # the load imports torch first: seconds without a beat on a loaded host
    )
    runs.append(run)

    def torch_running() -> bool:  # the launcher prints the load's heartbeat
        lines = run.out.splitlines()
        return any(x.startswith("alpha r0 loading_weights") and "torch running" in x for x in lines)

    wait_for(
        lambda: torch_running() and len(segments_of(run.child_pids().values())) == 1,
        120,
        "alpha running torch in its load with a segment\n" + run.err,
    )
    pids = run.child_pids()
    run.proc.kill()
    run.proc.wait(timeout=10)
    assert_all_gone(pids.values())
    assert segments_of(pids.values()) == [], f"the orphan's shared memory outlived it\n{run.err}"


def test_exit_after_ready_in_process(tmp_path, monkeypatch):
    cfg = write_config(tmp_path / "deploy.yaml", {"alpha": {}})
    out, err = io.StringIO(), io.StringIO()
    ready = tmp_path / "ready"
    code = launch(
        cfg, [], modules={"thinker": SCRIPT}, ready_file=ready, exit_after_ready=True, out=out, err=err
    )
    assert code == 0, err.getvalue()
    assert "ready in" in out.getvalue() and ready.read_text().startswith("127.0.0.1:")
    pids = [
        int(line.rsplit("(pid ", 1)[1].rstrip(")")) for line in out.getvalue().splitlines() if "(pid " in line
    ]
    assert pids and not any(alive(p) for p in pids)


def test_serve_sweeps_the_shm_segments_of_dead_processes(tmp_path):
    """A producer that crashed leaves its /dev/shm segment behind; the next `serve` removes it."""
    producer = (
        "import os; from omnistage.common.transport.host import Segment; "
        "seg = Segment.create(4096); print(seg.name, flush=True); os._exit(0)"
    )
    name = subprocess.run(
        [sys.executable, "-c", producer], capture_output=True, text=True, check=True
    ).stdout.strip()
    from omnistage.common.transport.host import SHM_DIR

    assert os.path.exists(os.path.join(SHM_DIR, name))
    cfg = write_config(tmp_path / "deploy.yaml", {"alpha": {}})
    code = launch(
        cfg, [], modules={"thinker": SCRIPT}, exit_after_ready=True, out=io.StringIO(), err=io.StringIO()
    )
    assert code == 0
    assert not os.path.exists(os.path.join(SHM_DIR, name)), "the dead producer's segment is still there"


def test_config_errors_exit_2_naming_the_key(tmp_path):
    cfg = write_config(tmp_path / "deploy.yaml", {"alpha": {}})
    err = io.StringIO()
    assert launch(cfg, ["services.alpha.tp_size=0"], err=err, out=io.StringIO()) == 2
    assert "services.alpha.tp_size: expected > 0, got 0" in err.getvalue()
    assert launch(tmp_path / "missing.yaml", err=err, out=io.StringIO()) == 2
    assert "no such deploy file" in err.getvalue()
    empty = tmp_path / "empty.yaml"
    empty.write_text("version: 1\n")
    assert launch(empty, err=err, out=io.StringIO()) == 2
    assert "has no services to start" in err.getvalue()


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    import socket

    cfg = write_config(tmp_path / "deploy.yaml", {"alpha": {}})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out, err = io.StringIO(), io.StringIO()
        for key in ("port", "admin_port", "metrics_port"):
            code = launch(
                cfg, [f"services.alpha.{key}={port}"], modules={"thinker": SCRIPT}, out=out, err=err
            )
            assert code == 2
            assert f"omnistage: services.alpha.{key} {port} is in use" in err.getvalue()
        code = launch(
            cfg,
            ["services.alpha.tp_size=2", f"services.alpha.dist_port={port - 1}"],
            modules={"thinker": SCRIPT},
            out=out,
            err=err,
        )
        assert code == 2 and f"services.alpha.dist_port+1 {port} is in use" in err.getvalue()
    assert "started" not in out.getvalue()


def test_a_missing_checkpoint_is_one_line_with_the_command_that_makes_one(tmp_path):
    cfg = write_config(tmp_path / "deploy.yaml", {"alpha": {}})
    out, err = io.StringIO(), io.StringIO()
    missing = tmp_path / "no-such-ckpt"
    assert launch(cfg, [f"model.checkpoint={missing}"], modules={"thinker": SCRIPT}, out=out, err=err) == 2
    assert err.getvalue() == (
        f"omnistage: model.checkpoint: {missing} does not exist (needed by alpha); make the tiny demo one with "
        f"`omnistage make-tiny-checkpoint {missing}`, or point model.checkpoint at a downloaded checkpoint\n"
    )
    assert "started" not in out.getvalue()


def test_a_config_only_checkpoint_is_enough_for_load_format_dummy(tmp_path):
    from omnistage.common.checkpoint.config_only import write_config_checkpoint
    from omnistage.common.preflight import checkpoint_problems

    ckpt = write_config_checkpoint(tmp_path / "ckpt", "tiny")
    cfg = load_config(write_config(tmp_path / "deploy.yaml", {"alpha": {}}), [f"model.checkpoint={ckpt}"])
    assert checkpoint_problems(cfg) == [
        f"model.checkpoint: {ckpt} has no *.safetensors weights (needed by alpha); make the tiny demo one with "
        f"`omnistage make-tiny-checkpoint {ckpt}`, or point model.checkpoint at a downloaded checkpoint"
    ]
    dummy = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, load_format="dummy"))
    assert checkpoint_problems(dummy) == []
    (ckpt / "tokenizer.json").unlink()
    assert "has no tokenizer.json" in checkpoint_problems(dummy)[0]


def test_a_missing_secret_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_ADMIN_KEY", raising=False)
    cfg = write_config(
        tmp_path / "deploy.yaml",
        {"alpha": {"admin_port": free_port(), "admin_api_key_env": "NO_SUCH_ADMIN_KEY"}},
    )
    err = io.StringIO()
    assert launch(cfg, [], modules={"thinker": SCRIPT}, out=io.StringIO(), err=err) == 2
    assert (
        "services.alpha.admin_api_key_env: environment variable NO_SUCH_ADMIN_KEY is not set or holds no key"
        in err.getvalue()
    )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_a_tls_gateway_is_health_checked_on_its_admin_port(tmp_path, runs):
    from tests.common.runtime.synthetic_stage import self_signed

    cert, key = self_signed(tmp_path, "server")
    tls = {"cert_file": str(cert), "key_file": str(key)}
    run = Run(tmp_path, {"front": {"kind": "gateway", "admin_port": free_port(), "tls": tls}})
    runs.append(run)
    address = run.wait_ready()
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(address, creds) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait_exit() == 0


def test_a_stop_asked_before_the_launcher_listens_ends_serve_cleanly(tmp_path):
    """`serve` defers SIGTERM from its first line (the CLI's imports and checks take seconds on a loaded
    host): the launcher takes it over, starts nothing and exits 0 instead of dying by the signal."""
    from omnistage.common import stop_signals

    cfg = write_config(tmp_path / "deploy.yaml", {"alpha": {}})
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop_signals.defer()
        os.kill(os.getpid(), signal.SIGTERM)  # the stop arrives while the CLI is still importing
        out, err = io.StringIO(), io.StringIO()
        assert launch(cfg, [], modules={"thinker": SCRIPT}, out=out, err=err) == 0, err.getvalue()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert "SIGTERM before start-up, stopping" in out.getvalue()
    assert "omnistage: started" not in out.getvalue() and stop_signals.take() is None


def test_the_launcher_and_the_cli_start_without_torch():
    """`serve` and the CLI's commands use only the transport's host module (segments, liveness):
    importing torch there would cost seconds of CPU at every start of the launcher and of a command."""
    code = "import sys, omnistage.common.launcher, omnistage.common.cli; print(sorted({'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
