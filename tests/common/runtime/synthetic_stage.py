"""A synthetic service for runtime and launcher tests: real phases, real gRPC, no model.

Run as a script (`python synthetic_stage.py --config ... --service ... --rank ... --run-dir ...`), it
is what `launch(modules={kind: this file})` starts. It walks through the start-up phases with
progress (step time from $SYNTH_STEP_S), then serves `omnistage.v1.Omni` on rank 0, where the prompt
text drives the behaviour: `raise`, `invalid`, `overloaded`, `echo <text>` (one delta: the text as
given), or `n=<events> delay=<seconds>`.
$SYNTH_TORCH_LOAD=1 makes its load run torch in a blocking thread that never ends. A synthetic gateway serves its capabilities' health names (text at once, the others
$SYNTH_CAPABILITIES_AFTER_S later). $SYNTH_CRASH_AFTER=`<service>:<seconds>` makes every process of that service exit (code 5) that
long after it is ready: a stage that keeps crashing, for the launcher's restart budget.
$SYNTH_GATEWAY_WATCH=`<service>:<seconds>` makes a synthetic gateway take its capabilities down while
that service is not SERVING, and up again that long after it is (a gateway's re-admission).
$SYNTH_SLOW_EXIT=1 makes every process, as it stops, register an exit handler that keeps it from
exiting for a minute (a stuck clean-up).
$SYNTH_SHM=1 makes every process create a /dev/shm segment first thing and never close it (a
producer whose pool no graceful stop reaches): the launcher, or the process's own watchdog, must.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from omnistage.common.runtime.blocking import in_daemon_thread
from omnistage.common.runtime.errors import InvalidRequest, Overloaded
from omnistage.common.runtime.stage_main import run_service
from omnistage.v1 import common_pb2, control_pb2, omni_pb2, omni_pb2_grpc

SCRIPT = str(Path(__file__).resolve())
_LEAKED: list[Any] = []  # $SYNTH_SHM segments, never closed
_BACKGROUND: list[Any] = []  # tasks that live as long as the service


class SyntheticOmni(omni_pb2_grpc.OmniServicer):
    """Streams `n` text deltas `delay` seconds apart, then a finish; or fails as the prompt asks."""

    def __init__(self) -> None:
        self.finished = 0

    async def Generate(self, request: omni_pb2.GenerateRequest, context: Any):
        text = request.messages[-1].parts[0].text if request.messages else ""
        if text == "raise":
            raise RuntimeError("synthetic handler bug")
        if text == "invalid":
            raise InvalidRequest("messages[0]: synthetic invalid request")
        if text == "overloaded":
            raise Overloaded("synthetic queue full", retry_after_ms=250)
        opts = dict(word.split("=", 1) for word in text.split() if "=" in word)
        n, delay = int(opts.get("n", 3)), float(opts.get("delay", 0.0))
        deltas = [text.removeprefix("echo ")] if text.startswith("echo ") else [f"w{i} " for i in range(n)]
        n = len(deltas)
        for delta in deltas:
            if delay:
                await asyncio.sleep(delay)
            yield omni_pb2.GenerateEvent(request_id=request.request_id, text=omni_pb2.TextDelta(text=delta))
        self.finished += 1
        usage = common_pb2.Usage(prompt_tokens=len(text.split()), completion_tokens=n)
        yield omni_pb2.GenerateEvent(
            request_id=request.request_id,
            finish=omni_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP, usage=usage),
        )


def _torch_forever(started: Any) -> None:
    import torch

    a = torch.randn(512, 512)
    a = torch.tanh(a @ a)
    started()
    while True:
        a = torch.tanh(a @ a)


def memory_report() -> list[control_pb2.MemoryReport]:
    return [
        control_pb2.MemoryReport(
            device="cpu", weights_bytes=3 << 20, kv_cache_bytes=1 << 20, total_bytes=4 << 20
        )
    ]


async def build(runtime: Any, cfg: Any, svc: Any, rank: int) -> None:
    step = float(os.environ.get("SYNTH_STEP_S", "0.02"))
    r = runtime.reporter
    if os.environ.get("SYNTH_SHM"):
        from omnistage.common.transport.host import Segment

        _LEAKED.append(Segment.create(4096))
    r.enter("loading_weights", total=3, unit="shards")
    if os.environ.get("SYNTH_TORCH_LOAD"):  # a load that runs torch in a blocking thread until stopped
        await in_daemon_thread(lambda: _torch_forever(lambda: r.heartbeat("torch running")), "synthetic-load")
    for _ in range(3):
        await asyncio.sleep(step)
        r.advance()
    r.enter("profiling_memory")
    await asyncio.sleep(step)
    r.enter("warming_up", total=1, unit="requests")
    await asyncio.sleep(step)
    r.advance()
    if runtime.serves_grpc:
        runtime.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, SyntheticOmni(), "omnistage.v1.Omni")
    if svc.kind == "gateway":
        # Like the real gateway: serves text first, the other capabilities once its stages are in
        # ($SYNTH_CAPABILITIES_AFTER_S later; "never" keeps them NOT_SERVING).
        later = [c for c in cfg.capabilities() if c != "text"]
        runtime.set_capability_health({c: c == "text" for c in cfg.capabilities()})
        after = os.environ.get("SYNTH_CAPABILITIES_AFTER_S", "0")
        if after != "never":
            loop = asyncio.get_running_loop()
            loop.call_later(
                float(after), runtime.set_capability_health, dict.fromkeys(["text", *later], True)
            )
        watched = os.environ.get("SYNTH_GATEWAY_WATCH", "")
        if watched:
            name, _, delay = watched.partition(":")
            _BACKGROUND.append(asyncio.create_task(_readmit(runtime, cfg, name, float(delay))))
    crash = os.environ.get("SYNTH_CRASH_AFTER", "")
    if crash.partition(":")[0] == svc.name:
        asyncio.get_running_loop().call_later(float(crash.partition(":")[2]), os._exit, 5)
    if os.environ.get("SYNTH_SLOW_EXIT"):
        import atexit
        import time

        runtime.add_shutdown_hook(lambda: atexit.register(time.sleep, 60))
    runtime.set_memory_provider(memory_report)
    runtime.set_limits_provider(
        lambda: control_pb2.Limits(max_running_requests=4, max_message_bytes=svc.max_message_bytes)
    )


async def _readmit(runtime: Any, cfg: Any, name: str, delay_s: float) -> None:
    """A synthetic gateway's watch of `name`: capabilities down while it is not SERVING, up `delay_s`
    after it is again."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    caps, down = cfg.capabilities(), False
    async with grpc.aio.insecure_channel(cfg.address(name)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                serving = (await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)).status == 1
            except grpc.aio.AioRpcError:
                serving = False
            if not serving and not down:
                down = True
                runtime.set_capability_health(dict.fromkeys(caps, False))
            elif serving and down:
                await asyncio.sleep(delay_s)
                down = False
                print(f"synthetic gateway: admitted {name}", flush=True)
                runtime.set_capability_health(dict.fromkeys(caps, True))
            await asyncio.sleep(0.05)


# -- helpers of the tests ------------------------------------------------------------------------


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed P-256 certificate for localhost / 127.0.0.1 (its own CA), made by the openssl command."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            f"/CN={name}",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def free_port() -> int:
    """A free port never handed out before in this process (`chaos_launch.free_ports`: the one owner)."""
    from load_tests.chaos_launch import free_ports  # here: this file also runs as the stage script

    return free_ports(1)[0]


def write_config(
    path: Path,
    services: dict[str, dict],
    supervision: dict | None = None,
    devices: dict | None = None,
    **startup: Any,
) -> Path:
    """A deploy file of synthetic services with short deadlines (tests override what they probe)."""
    deadlines = {
        p: 10.0 for p in ("starting", "loading_weights", "profiling_memory", "warming_up", "capturing_graphs")
    }
    deadlines.update(startup.pop("phase_deadlines_s", {}))
    ckpt = (
        path.parent / "synthetic-ckpt"
    )  # `serve` checks that the checkpoint exists; synthetic stages never read it
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"")
    data = {
        "version": 1,
        "host": "127.0.0.1",
        "log_level": "warning",
        "model": {"checkpoint": str(ckpt)},
        "startup": {
            "phase_deadlines_s": deadlines,
            "heartbeat_timeout_s": 10.0,
            "poll_interval_s": 0.05,
            "rpc_timeout_s": 1.0,
            "stop_grace_s": 3.0,
            **startup,
        },
        "supervision": supervision or {},
        "devices": devices or {},
        "services": {},
    }
    for name, extra in services.items():
        svc = {"kind": "thinker", "port": free_port(), "drain_grace_s": 2.0, **extra}
        if svc.get("tp_size", 1) > 1 and "dist_port" not in svc:
            # Imported here: this file also runs as the stage script, where load_tests is not on the path.
            from load_tests.chaos_launch import free_port_block

            svc["dist_port"] = free_port_block(svc["tp_size"])
        data["services"][name] = svc
    path.write_text(yaml.safe_dump(data))
    return path


if __name__ == "__main__":
    run_service(sys.argv[1:], None, build)
