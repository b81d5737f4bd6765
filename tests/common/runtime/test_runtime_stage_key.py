"""Stages take calls only from the deployment's processes: the stage key (auth.py)."""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile

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


def test_a_bidirectional_call_with_a_wrong_key_is_unauthenticated_however_its_client_writes(
    tmp_path, monkeypatch
):
    """Issue 43.11: a grpc.aio client still writing when the refusal came reported INTERNAL (its failed
    write hides the status: grpc/grpc#36066). The stage lets it finish writing, then refuses."""
    monkeypatch.setenv(auth.STAGE_KEY_ENV, "deployment-key")
    big = omni_pb2.ConverseRequest(config=omni_pb2.GenerateRequest(system_prompt="x" * 100_000))

    async def late_then_waits():  # its first write comes after the call began, then it waits
        await asyncio.sleep(0.2)
        yield omni_pb2.ConverseRequest()
        await asyncio.sleep(30)

    async def keeps_writing():  # 5 MB in a row
        for _ in range(50):
            yield big

    async def scenario(rt):
        codes = []
        async with grpc.aio.insecure_channel(rt.address) as ch:
            for requests in (late_then_waits, keeps_writing):
                for metadata in ((), auth.bearer("guess")):
                    call = omni_pb2_grpc.OmniStub(ch).Converse(requests(), timeout=30, metadata=metadata)
                    try:
                        [e async for e in call]
                    except grpc.aio.AioRpcError as exc:  # `omnistage.v1.Omni: invalid key: ...`
                        why = exc.details().split(": ")[1] if exc.details().count(": ") > 1 else exc.details()
                        codes.append((requests.__name__, exc.code(), why))
        return codes

    assert _serve(tmp_path, "talker", scenario) == [
        (name, grpc.StatusCode.UNAUTHENTICATED, why)
        for name in ("late_then_waits", "keeps_writing")
        for why in ("missing credentials", "invalid key")
    ]


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


def test_serve_keys_its_stages_and_the_cli_finds_the_run_and_prints_its_key_to_its_owner(
    tmp_path, monkeypatch, capsys
):
    """`serve` without $OMNISTAGE_STAGE_KEY makes a key: its stage refuses a local caller without it,
    naming the stage key (never echoing one). `serve` records its run: `status` with no flags describes
    it, `status --address <a stage's admin port>` presents the run's stage key, and `stage-key` prints
    the key that opens the stage's own port to an outside client. When `serve` stops, its record and
    key go, and the CLI says it finds no running serve."""
    from omnistage.common.cli import main

    from tests.common.test_launcher import Run

    private = tmp_path / "tmp"  # this test's own user directory: no other test's `serve` is "current"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    monkeypatch.delenv(auth.STAGE_KEY_ENV, raising=False)  # restored after: `status` adopts the run's key
    run = Run(tmp_path, {"alpha": {"admin_port": free_port()}}, env={"TMPDIR": str(private)})
    try:
        run.wait_ready()
        cfg = load_config(run.cfg)
        assert main(["status"]) == 0
        assert f"alpha (thinker) admin {cfg.admin_address('alpha')}: SERVING" in capsys.readouterr().out
        monkeypatch.delenv(auth.STAGE_KEY_ENV)
        assert main(["status", "--address", cfg.admin_address("alpha")]) == 0
        assert "alpha (thinker)" in capsys.readouterr().out
        assert main(["stage-key"]) == 0
        key = capsys.readouterr().out.strip()
        monkeypatch.delenv(auth.STAGE_KEY_ENV, raising=False)

        async def outside_client():
            async with grpc.aio.insecure_channel(cfg.address("alpha")) as ch:
                stub = omni_pb2_grpc.OmniStub(ch)
                try:
                    [e async for e in stub.Generate(_request(), timeout=10)]
                except grpc.aio.AioRpcError as exc:
                    refused = exc.code(), exc.details()
                events = [e async for e in stub.Generate(_request(), timeout=10, metadata=auth.bearer(key))]
                return refused, events[-1].WhichOneof("event")

        (code, refused), last = asyncio.run(outside_client())
        assert code == grpc.StatusCode.UNAUTHENTICATED and last == "finish"
        assert (
            "missing credentials: this port takes the stage key ($OMNISTAGE_STAGE_KEY; `omnistage stage-key`"
            in refused
        )
        assert key not in refused
    finally:
        run.proc.send_signal(signal.SIGTERM)
        run.proc.wait(timeout=60)
    assert not auth.stage_key_path(run.cfg).exists()
    assert main(["status"]) == 2
    assert "no running `omnistage serve` of this user found" in capsys.readouterr().err
    assert main(["stage-key", "--config", str(run.cfg)]) == 1
    record = json.loads((tmp_path / "run" / "run.json").read_text())  # the run dir keeps its record
    assert record["config"] == str(run.cfg.resolve()) and record["overrides"] == []
    assert record["admin"] == {"alpha": cfg.admin_address("alpha")} and key not in json.dumps(record)


def test_serve_takes_the_stage_key_of_its_environment_else_makes_one():
    assert auth.new_stage_key({auth.STAGE_KEY_ENV: " mine "}) == "mine"
    made = {auth.new_stage_key({}) for _ in range(2)}
    assert len(made) == 2 and all(len(k) >= 40 for k in made)  # fresh, 256 bits each
