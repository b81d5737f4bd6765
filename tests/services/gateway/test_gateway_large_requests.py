"""A gateway process gives back the memory of large refused requests (RSS stays flat)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import yaml
from omnistage.common.runtime.status_file import read_status, status_path
from omnistage.v1 import omni_pb2, omni_pb2_grpc

from tests.common.runtime.synthetic_stage import free_port
from tests.waits import wait_for

MIB = 1 << 20
# Generous: the interpreter, grpc's buffers and the allocator keep some; 3 x 60 MiB would be ~180+ MiB.
TOLERANCE_BYTES = 40 * MIB
TRIM_INTERVAL_S = 0.5  # services.<name>.memory_trim_interval_s


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def refused(address: str, text: str) -> grpc.StatusCode:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=text)])
    options = [("grpc.max_send_message_length", 128 * MIB)]
    with grpc.insecure_channel(address, options=options) as ch, pytest.raises(grpc.RpcError) as err:
        list(omni_pb2_grpc.OmniStub(ch).Generate(omni_pb2.GenerateRequest(messages=[msg]), timeout=60))
    return err.value.code()


@pytest.fixture
def gateway(tmp_path):
    """A gateway process with no stages (every request is refused), SERVING; yields (address, pid).

    Its prompt limit (16 M characters) makes 60 MiB a size its public API receives (the receive limit
    is what a legitimate request can carry), so the requests are parsed before they are refused. Its
    trims may run TRIM_INTERVAL_S apart (the default 10 s would be most of this test's time)."""
    gw = {
        "kind": "gateway",
        "port": free_port(),
        "drain_grace_s": 1.0,
        "memory_trim_interval_s": TRIM_INTERVAL_S,
        "gateway": {"max_prompt_chars": 16_000_000},
    }
    cfg = {"log_level": "warning", "services": {"gateway": gw}}
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omnistage.services.gateway",
            "--config",
            str(path),
            "--service",
            "gateway",
            "--run-dir",
            str(run),
        ]
    )
    try:
        status = status_path(run, "gateway", 0)
        rec = wait_for(
            lambda: (r := read_status(status)) is not None and r.phase == "serving" and r,
            60,
            "gateway serving",
        )
        yield rec.address, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_rss_at_most(pid: int, limit: int, timeout_s: float = 30.0) -> int:
    """RSS of `pid` once it is <= limit, or what it is after `timeout_s` (a trim runs at most every
    TRIM_INTERVAL_S, half a second after a large request)."""
    deadline = time.monotonic() + timeout_s
    rss = rss_bytes(pid)
    while rss > limit and time.monotonic() < deadline:
        time.sleep(0.5)
        rss = rss_bytes(pid)
    return rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/statm")
def test_rss_after_large_refused_requests_comes_back(gateway):
    address, pid = gateway
    for _ in range(3):  # warm up grpc's buffers and the allocator with small requests
        assert refused(address, "hello") == grpc.StatusCode.UNAVAILABLE
    before = rss_bytes(pid)
    big = "x" * (60 * MIB)
    for _ in range(3):  # one after the other: each parsed, then refused (prompt longer than max_prompt_chars)
        assert refused(address, big) == grpc.StatusCode.INVALID_ARGUMENT
    after = wait_rss_at_most(pid, before + TOLERANCE_BYTES)
    assert after <= before + TOLERANCE_BYTES, (
        f"RSS {before / MIB:.0f} MiB before, {after / MIB:.0f} MiB 30 s after 3 refused 60 MiB requests"
    )
    with ThreadPoolExecutor(4) as pool:  # at once: the allocator's arenas fragment
        assert set(pool.map(lambda _: refused(address, big), range(4))) == {grpc.StatusCode.INVALID_ARGUMENT}
    after = wait_rss_at_most(pid, before + TOLERANCE_BYTES)
    assert after <= before + TOLERANCE_BYTES, (
        f"RSS {before / MIB:.0f} MiB before, {after / MIB:.0f} MiB 30 s after 4 concurrent refused 60 MiB requests"
    )
