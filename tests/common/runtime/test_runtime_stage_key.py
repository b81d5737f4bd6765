"""Stages take calls only from the deployment's processes: the stage key (auth.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import config_from_dict, load_config
from omnistage.common.runtime import auth
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.services.gateway.stages import StageClient
from omnistage.v1 import control_pb2, control_pb2_grpc, omni_pb2, omni_pb2_grpc

from tests.common.runtime.synthetic_stage import SyntheticOmni, free_port

OMNI = "omnistage.v1.Omni"


def _request() -> omni_pb2.GenerateRequest:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="n=1 delay=0")])
    return omni_pb2.GenerateRequest(messages=[msg])


async def _codes(address: str, admin: str, metadata=()) -> tuple[grpc.StatusCode, grpc.StatusCode, int]:
    """(Generate's code, Control.Describe's code, health status) as a caller sending `metadata` gets them."""
    async with grpc.aio.insecure_channel(address) as ch, grpc.aio.insecure_channel(admin) as ach:
        try:
            [e async for e in omni_pb2_grpc.OmniStub(ch).Generate(_request(), timeout=10, metadata=metadata)]
            generate = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            generate = exc.code()
        try:
            await control_pb2_grpc.ControlStub(ach).Describe(
                control_pb2.DescribeRequest(), timeout=10, metadata=metadata
            )
            describe = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            describe = exc.code()
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return generate, describe, health.status


def _serve(tmp_path, kind: str, scenario):
    async def main():
        cfg = config_from_dict({"services": {"s": {"kind": kind, "port": 1, "admin_port": free_port()}}})
        rt = ServiceRuntime(cfg, cfg.service("s"), 0, run_dir=tmp_path, port=0, metrics_port=0)
        await rt.start()
        rt.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, SyntheticOmni(), OMNI)
        rt.set_serving()
        try:
            return await scenario(rt)
        finally:
            rt.request_stop()
            await asyncio.wait_for(rt.serve_until_stopped(), 10)

    return asyncio.run(main())


def test_a_stage_answers_only_callers_with_the_stage_key(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.STAGE_KEY_ENV, "deployment-key")

    async def scenario(rt):
        return (
            await _codes(rt.address, rt.admin_address),
            await _codes(rt.address, rt.admin_address, auth.bearer("guess")),
            await _codes(rt.address, rt.admin_address, auth.bearer("deployment-key")),
        )

    anyone, guess, member = _serve(tmp_path, "thinker", scenario)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert anyone == (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED, serving)
    assert guess == (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED, serving)
    assert member == (grpc.StatusCode.OK, grpc.StatusCode.OK, serving)


def test_the_gateway_keeps_its_own_keys_and_its_stage_channels_present_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.STAGE_KEY_ENV, "deployment-key")

    async def gateway(rt):
        return await _codes(rt.address, rt.admin_address)

    ok = grpc.StatusCode.OK
    assert _serve(tmp_path, "gateway", gateway)[:2] == (ok, ok)  # its clients' keys are api_keys_env

    async def through_stage_client(rt):
        client = StageClient("s", rt.address, 1 << 20, admin_address=rt.admin_address)
        try:
            events = [
                e async for e in omni_pb2_grpc.OmniStub(client.channel).Generate(_request(), timeout=10)
            ]
            await client.control.Describe(control_pb2.DescribeRequest(), timeout=10)
            return events
        finally:
            await client.channel.close()
            await client.admin_channel.close()

    assert _serve(tmp_path, "thinker", through_stage_client)[-1].WhichOneof("event") == "finish"


def test_serve_makes_a_key_for_its_stages_and_its_cli_finds_it(tmp_path):
    """`serve` without $OMNISTAGE_STAGE_KEY: its stage refuses a local caller without the key it made,
    while `omnistage status` of the same deploy file still reads every stage's Describe."""
    from tests.common.test_launcher import Run

    env = {k: v for k, v in os.environ.items() if k != auth.STAGE_KEY_ENV}
    saved = os.environ.pop(auth.STAGE_KEY_ENV, None)
    try:
        run = Run(tmp_path, {"alpha": {"admin_port": free_port()}})
    finally:
        if saved is not None:
            os.environ[auth.STAGE_KEY_ENV] = saved
    try:
        run.wait_ready()
        cfg = load_config(run.cfg)
        code = asyncio.run(_codes(cfg.address("alpha"), cfg.admin_address("alpha")))[:2]
        assert code == (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED)
        status = subprocess.run(
            [sys.executable, "-m", "omnistage.common.cli", "status", "--config", str(run.cfg)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert "alpha" in status.stdout and "serving" in status.stdout.lower()
    finally:
        run.kill()
    assert not auth.stage_key_path(run.cfg).exists() or run.proc.returncode == -9
