"""What the e2e tests of real services share: free local ports, a metric read off /metrics, and an
`omnistage serve` process of a deploy dict with its output in a file.

`wait_started` is the one launch-and-wait of the e2e tests (`ServeProcess.wait_ready` for `omnistage
serve`; a pipeline of one process per service calls it too): every wait has a deadline, and a start that
fails or runs out of time names the stage, rank and phase each process last reported (the status files,
in a run directory of the test's own) above the processes' output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.runtime.deadlines import Deadline
from omnistage.common.runtime.status_file import read_status

from load_tests.chaos_launch import (
    free_port_block,  # noqa: F401 - `n` consecutive ports free now (a thinker's dist_port)
    free_ports,  # noqa: F401 - `n` ports free now, held at once while picked
    leftovers,
    started_children,
)
from tests.waits import timeout_message


def metric(url: str, prefix: str, default: float | None = None) -> float:
    """The sample starting with `prefix`. One that is not exported fails unless `default` is given (a
    labelled counter appears only once counted): a check of 0 must not pass on a missing gauge."""
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        raise AssertionError(f"{url} exports no {prefix}")
    return default


def exposition_with_codes(url: str, *codes: str) -> str:
    """The /metrics text at `url`, checked to hold an `omnistage_rpc_requests_total` series for each gRPC
    status in `codes`: a test's own traffic made them, so that a check of the exposition (promtool) sees
    the labelled series, whatever ran before it (labelled series appear only once counted)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    rpcs = [line for line in text.splitlines() if line.startswith("omnistage_rpc_requests_total{")]
    for code in codes:
        assert any(f'code="{code}"' in line for line in rpcs), f"{url} counts no {code} RPC: {rpcs}"
    return text


def capabilities_ready(address: str, names: list[str]) -> bool:
    """Whether the gateway at `address` serves every capability in `names` (its health names
    omnistage.v1.Omni.<capability>: it serves text before its other stages are in)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in names:
            try:
                reply = stub.Check(
                    health_pb2.HealthCheckRequest(service=f"omnistage.v1.Omni.{name}"), timeout=5
                )
            except grpc.RpcError:
                return False
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
    return True


def stage_diagnosis(run_dir: Path) -> str:
    """One line per process under `run_dir` that is not serving: its stage, rank, phase, and its progress
    or failure (what each last wrote to its status file)."""
    lines = []
    for path in sorted(run_dir.glob("*.r*.json")):
        rec = read_status(path)
        if rec is None or rec.phase == "serving":
            continue
        where = f"{rec.service} r{rec.rank} in phase {rec.failed_in or rec.phase}"
        what = rec.failure if rec.phase == "failed" else rec.progress_text()
        lines.append(f"{where}: {what}" if what else where)
    return "\n".join(lines) or f"every stage that wrote a status under {run_dir} is serving"


def wait_started(
    what: str,
    ready: Callable[[], bool],
    exited: Callable[[], str],
    deadline_s: float,
    run_dir: Path,
    logs: Callable[[], str],
    on_failure: Callable[[], None] = lambda: None,
) -> None:
    """The one launch-and-wait of the e2e tests: poll `ready` until true. When `exited` names a process that
    ended first, or `deadline_s` passes, `on_failure` (stop what was started), then fail the test with the
    stages still starting (`stage_diagnosis` of `run_dir`) above the `logs`."""
    deadline = Deadline(deadline_s)
    while not ready():
        dead = exited()
        if dead or deadline.expired():
            on_failure()
            why = (
                f"{dead} ended before {what} was ready"
                if dead
                else timeout_message(deadline_s, f"{what} to be ready")
            )
            pytest.fail(f"{why}; not serving:\n{stage_diagnosis(run_dir)}\n{logs()}")
        time.sleep(0.2)


class ServeProcess:
    """`omnistage serve` of the deploy dict `cfg` written under `root` (`tag` keeps several apart; `env` adds
    environment variables, e.g. the API keys the deploy file names). Its output goes to `out`, or with
    `err_apart` its stderr (the launcher's verdicts: a failed start, a dead rank) to `err` alone."""

    def __init__(
        self, root: Path, cfg: dict, tag: str = "", env: dict[str, str] | None = None, err_apart: bool = False
    ) -> None:
        self.cfg_path = root / f"deploy{tag}.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg))
        self.ready = root / f"ready{tag}"
        self.run_dir = root / f"run{tag}"
        self.out = root / f"serve{tag}.txt"
        self.err = root / f"serve{tag}.err.txt" if err_apart else None
        with open(self.out, "w") as out, open(self.err or os.devnull, "w") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "omnistage.common.cli",
                    "serve",
                    str(self.cfg_path),
                    "--ready-file",
                    str(self.ready),
                    "--run-dir",
                    str(self.run_dir),
                ],
                stdout=out,
                stderr=err if self.err else subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            )

    @property
    def address(self) -> str:
        """The gateway address `serve` wrote to its ready file (empty before it is ready)."""
        return self.ready.read_text().strip() if self.ready.exists() else ""

    def logs(self) -> str:
        text = self.out.read_text() + (self.err.read_text() if self.err else "")
        return text[-4000:]

    def wait_ready(self, deadline_s: float) -> ServeProcess:
        """Until the ready file names the gateway; a `serve` that exits first, or is not ready within
        `deadline_s`, fails the test naming the stages still starting (and is killed)."""

        def exit_code() -> str:
            return "" if self.proc.poll() is None else f"omnistage serve (exit {self.proc.returncode})"

        wait_started(
            "omnistage serve",
            lambda: bool(self.address),
            exit_code,
            deadline_s,
            self.run_dir,
            lambda: f"--- omnistage serve ---\n{self.logs()}",
            on_failure=self.kill,
        )
        return self

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        """The launcher's exit code; one still running `timeout_s` later is killed and fails the test."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(
                f"omnistage serve still running {timeout_s:g}s later:\n{stage_diagnosis(self.run_dir)}\n"
                f"{self.logs()}"
            )

    def stop(self) -> None:
        """SIGTERM; the launcher must stop every service and exit 0 within a minute."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.wait_exit(60.0)
        assert code == 0, f"omnistage serve exited with code {code} after SIGTERM:\n{self.logs()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def children(self) -> dict[tuple[str, int], int]:
        """The pid of every process the launcher started, by service and rank (from its output)."""
        return started_children(self.out.read_text())

    def leftovers(self) -> list[str]:
        """Kill `serve` if it still runs; then the processes and shm segments of this launch still there
        after 5 s (removed, so that nothing reaches the next test)."""
        self.kill()
        return leftovers(list(self.children().values()), self.cfg_path, 5.0)
