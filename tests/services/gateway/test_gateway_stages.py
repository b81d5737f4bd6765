"""The gateway's stage client: a stream that finished is read to its end (the stage counts it OK), one
left early is cancelled (the stage aborts it); Describe goes to the stage's admin port with its key."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from omnistage.common import metrics
from omnistage.common.config import GatewayConfig, config_from_dict
from omnistage.common.runtime.errors import StageUnavailable
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.services.gateway.stage_watch import StageWatch
from omnistage.services.gateway.stages import ThinkerClient
from omnistage.v1 import common_pb2, thinker_pb2, thinker_pb2_grpc

from tests.common.runtime.synthetic_stage import free_port
from tests.waits import wait_for_async


class FakeThinker(thinker_pb2_grpc.ThinkerServicer):
    """`n` deltas 20 ms apart, then a finish, then 100 ms of clean-up before the stream ends (the window in
    which a client that cancels after the finish turns a finished request into CANCELLED)."""

    async def Generate(self, request: thinker_pb2.ThinkerRequest, context: Any):
        for i in range(int(request.chat.pieces[0].text if request.chat.pieces else "3")):
            await asyncio.sleep(0.02)
            yield thinker_pb2.ThinkerEvent(delta=thinker_pb2.TokenDelta(text=f"t{i} ", token_ids=[i]))
        yield thinker_pb2.ThinkerEvent(finish=thinker_pb2.ThinkerFinish(reason=common_pb2.FINISH_REASON_STOP))
        await asyncio.sleep(0.1)


def counted(service: str, code: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "omnistage_rpc_requests_total", {"service": service, "method": "Generate", "code": code}
    )
    return value or 0.0


async def consume(client: ThinkerClient, text: str, stop_after: int | None = None) -> list[str]:
    """Read like the gateway's servicer does: stop at the finish (or after `stop_after` events), then close."""
    kinds = []
    prompt = thinker_pb2.ChatPrompt(pieces=[thinker_pb2.PromptPiece(text=text)])
    stream = client.generate("r1", prompt, common_pb2.SamplingParams(), 10.0)
    try:
        async for event in stream:
            kinds.append(event.WhichOneof("event"))
            if kinds[-1] == "finish" or len(kinds) == stop_after:
                break
    finally:
        await stream.aclose()
    return kinds


def test_finished_streams_count_ok_at_the_stage_and_abandoned_ones_cancelled(tmp_path, monkeypatch):
    name = "fake_thinker_counts"
    monkeypatch.setenv("FAKE_THINKER_ADMIN_KEY", "admin-key")

    async def scenario():
        svc = {
            "kind": "thinker",
            "port": free_port(),
            "admin_port": free_port(),
            "admin_api_key_env": "FAKE_THINKER_ADMIN_KEY",
        }
        cfg = config_from_dict({"services": {name: svc}})
        rt = ServiceRuntime(cfg, cfg.service(name), 0, run_dir=tmp_path)
        await rt.start()
        rt.add_servicer(thinker_pb2_grpc.add_ThinkerServicer_to_server, FakeThinker(), "omnistage.v1.Thinker")
        rt.set_serving()
        client = ThinkerClient(
            name,
            cfg.address(name),
            1 << 20,
            admin_address=cfg.admin_address(name),
            admin_metadata=(("authorization", "Bearer admin-key"),),
        )
        try:
            watch = StageWatch(client, GatewayConfig(stage_health_interval_s=0.05, stage_health_failures=2))
            watch.start()
            assert await watch.wait_admitted(10)
            assert (await client.describe()).name == name
            for _ in range(3):
                assert await consume(client, "3") == ["delta"] * 3 + ["finish"]
            await wait_for_async(lambda: rt.in_flight == 0, 5, "streams ended")
            assert (counted(name, "OK"), counted(name, "CANCELLED")) == (3.0, 0.0)
            assert await consume(client, "50", stop_after=2) == ["delta"] * 2
            await wait_for_async(lambda: rt.in_flight == 0, 5, "abandoned stream aborted")
            assert (counted(name, "OK"), counted(name, "CANCELLED")) == (3.0, 1.0)
        finally:
            await watch.stop()
            await client.close()
            rt.request_stop()
            await asyncio.wait_for(rt.serve_until_stopped(), 10)

    asyncio.run(scenario())


def test_describe_without_the_admin_key_is_refused(tmp_path, monkeypatch):
    import grpc

    name = "fake_thinker_keyed"
    monkeypatch.setenv("FAKE_THINKER_ADMIN_KEY", "admin-key")

    async def scenario():
        svc = {
            "kind": "thinker",
            "port": free_port(),
            "admin_port": free_port(),
            "admin_api_key_env": "FAKE_THINKER_ADMIN_KEY",
        }
        cfg = config_from_dict({"services": {name: svc}})
        rt = ServiceRuntime(cfg, cfg.service(name), 0, run_dir=tmp_path)
        await rt.start()
        client = ThinkerClient(name, cfg.address(name), 1 << 20, admin_address=cfg.admin_address(name))
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.describe()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await client.close()
            rt.request_stop()
            await asyncio.wait_for(rt.serve_until_stopped(), 10)

    asyncio.run(scenario())


def test_capability_readiness_is_served_as_health_names_and_in_describe(tmp_path):
    """A capability is SERVING under `omnistage.v1.Omni.<name>` only while the service serves and the
    capability is ready; Describe lists each with why not (what `omnistage status` prints)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from omnistage.v1 import control_pb2, control_pb2_grpc

    name = "fake_gateway_ready"

    async def scenario():
        cfg = config_from_dict(
            {"services": {name: {"kind": "gateway", "port": free_port(), "admin_port": free_port()}}}
        )
        rt = ServiceRuntime(cfg, cfg.service(name), 0, run_dir=tmp_path)
        await rt.start()
        why = {"speech": "talker: starting (not SERVING yet)"}
        rt.set_readiness_provider(
            lambda: [
                control_pb2.Readiness(capability=c, ready=c not in why, reason=why.get(c, ""))
                for c in ("text", "speech")
            ]
        )
        rt.set_capability_health({"text": True, "speech": False})

        async def health(service: str) -> int:
            async with grpc.aio.insecure_channel(cfg.address(name)) as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=service)
                )
                return resp.status

        async def until(check, want: int) -> None:  # health follows in a task of the loop
            for _ in range(100):
                if await check() == want:
                    return
                await asyncio.sleep(0.05)
            assert await check() == want

        try:
            serving, not_serving = (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            )
            assert await health("omnistage.v1.Omni.text") == not_serving  # not serving yet as a whole
            rt.set_serving()
            await until(lambda: health("omnistage.v1.Omni.text"), serving)
            assert await health("omnistage.v1.Omni.speech") == not_serving
            async with grpc.aio.insecure_channel(cfg.admin_address(name)) as ch:
                desc = await control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest())
            assert [(r.capability, r.ready, r.reason) for r in desc.readiness] == [
                ("text", True, ""),
                ("speech", False, "talker: starting (not SERVING yet)"),
            ]
            rt.set_capability_health({"text": True, "speech": True})
            await until(lambda: health("omnistage.v1.Omni.speech"), serving)
        finally:
            rt.request_stop()
            await asyncio.wait_for(rt.serve_until_stopped(), 10)

    asyncio.run(scenario())


def test_a_stream_broken_in_the_client_is_the_stage_unavailable_not_internal():
    """grpc's "Internal error from Core" (a write into a connection the stage broke by dying) names the
    stage as UNAVAILABLE; the stage's own INTERNAL stays INTERNAL."""

    async def main():
        client = ThinkerClient("thinker", "127.0.0.1:1", 1 << 20)
        try:
            broken = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, None, None, "Internal error from Core")
            err = client.error(broken)
            assert isinstance(err, StageUnavailable) and err.code == grpc.StatusCode.UNAVAILABLE
            assert str(err) == "stage 'thinker' is unavailable: the stream broke (Internal error from Core)"
            own = client.error(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, None, None, "engine bug"))
            assert own.code == grpc.StatusCode.INTERNAL and "engine bug" in str(own)
        finally:
            await client.close()

    asyncio.run(main())
