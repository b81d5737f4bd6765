"""What the e2e tests of real services share: free local ports, a metric read off /metrics, and an
`omnistage serve` process of a deploy dict with its output in a file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from load_tests.chaos_launch import free_ports  # noqa: F401 - `n` ports free now, held at once while picked


def metric(url: str, prefix: str, default: float | None = None) -> float:
    """The sample starting with `prefix`. One that is not exported fails unless `default` is given (a
    labelled counter appears only once counted): a check of 0 must not pass on a missing gauge."""
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        raise AssertionError(f"{url} exports no {prefix}")
    return default


def capabilities_ready(address: str, names: list[str]) -> bool:
    """Whether the gateway at `address` serves every capability in `names` (its health names
    omnistage.v1.Omni.<capability>: it serves text before its other stages are in)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in names:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=f"omnistage.v1.Omni.{name}"), timeout=5)
            except grpc.RpcError:
                return False
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
    return True


class ServeProcess:
    """`omnistage serve` of the deploy dict `cfg` written under `root` (`tag` keeps several apart; `env` adds
    environment variables, e.g. the API keys the deploy file names)."""

    def __init__(self, root: Path, cfg: dict, tag: str = "", env: dict[str, str] | None = None) -> None:
        path = root / f"deploy{tag}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.ready = root / f"ready{tag}"
        self.out = root / f"serve{tag}.txt"
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "omnistage.common.cli", "serve", str(path), "--ready-file", str(self.ready)],
                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            )  # fmt: skip

    def logs(self) -> str:
        return self.out.read_text()[-4000:]

    def wait_ready(self, deadline_s: float) -> ServeProcess:
        deadline = time.monotonic() + deadline_s
        while not (self.ready.exists() and self.ready.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"pipeline did not start (exit {self.proc.returncode}):\n{self.logs()}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        """SIGTERM; the launcher must stop every service and exit 0 within a minute."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"omnistage serve did not stop within 60s of SIGTERM:\n{self.logs()}")
        assert code == 0, self.logs()
