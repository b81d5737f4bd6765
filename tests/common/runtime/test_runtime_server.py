"""ServiceRuntime in process: health follows the phase, Describe, Drain, limits, errors, reflection, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from omnistage.common.config import config_from_dict, config_hash
from omnistage.common.runtime.deadlines import wait_for_async
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.status_file import read_status, status_path
from omnistage.v1 import control_pb2, control_pb2_grpc, omni_pb2, omni_pb2_grpc
from synthetic_stage import SyntheticOmni, free_port, memory_report

OMNI = "omnistage.v1.Omni"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def make_runtime(tmp_path, name="alpha", metrics_port=0, **svc) -> ServiceRuntime:
    cfg = config_from_dict({
        "services": {name: {"kind": "thinker", "port": 1, "max_message_bytes": 65536, "drain_grace_s": 2.0, **svc}}
    })
    return ServiceRuntime(cfg, cfg.service(name), 0, run_dir=tmp_path, port=0, metrics_port=metrics_port)


def request(text: str) -> omni_pb2.GenerateRequest:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=text)])
    return omni_pb2.GenerateRequest(request_id="r1", messages=[msg])


@contextlib.asynccontextmanager
async def running(tmp_path, serving: bool = True, **kw) -> AsyncIterator[ServiceRuntime]:
    """A started runtime (serving the synthetic Omni API), always stopped at the end."""
    rt = make_runtime(tmp_path, **kw)
    await rt.start()
    try:
        if serving:
            rt.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, SyntheticOmni(), OMNI)
            rt.set_serving()
        yield rt
    finally:
        if rt._server is not None:
            await stop(rt)


async def health_status(channel, service: str = "") -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    return reply.status


async def eventually_serving(channel, timeout_s: float = 5.0) -> bool:
    """Health is updated by a task after the phase change: poll it, with a deadline."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        if await health_status(channel) == SERVING:
            return True
        await asyncio.sleep(0.02)
    return False


async def collect(channel, text: str) -> list[omni_pb2.GenerateEvent]:
    return [e async for e in omni_pb2_grpc.OmniStub(channel).Generate(request(text), timeout=10)]


async def stop(rt: ServiceRuntime) -> int:
    rt.request_stop()
    return await asyncio.wait_for(rt.serve_until_stopped(), timeout=10)


def test_health_follows_phase_and_describe_reports_progress(tmp_path):
    async def scenario():
        async with running(tmp_path, serving=False) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            control = control_pb2_grpc.ControlStub(ch)
            assert await health_status(ch) == NOT_SERVING
            d = await control.Describe(control_pb2.DescribeRequest(), timeout=2)
            assert d.progress.phase == control_pb2.PHASE_STARTING

            rt.reporter.enter("loading_weights", total=3, unit="shards")
            rt.reporter.advance(detail="shard-00001")
            d = await control.Describe(control_pb2.DescribeRequest(), timeout=2)
            assert (d.progress.phase, d.progress.done, d.progress.total) == (control_pb2.PHASE_LOADING_WEIGHTS, 1, 3)
            assert (d.progress.unit, d.progress.detail) == ("shards", "shard-00001")
            assert d.progress.updated_unix_ms > 0
            assert d.name == "alpha" and d.kind == control_pb2.STAGE_KIND_THINKER
            assert d.config_hash == config_hash(rt.svc) and len(d.config_hash) == 64
            assert d.pid == os.getpid() and d.world_size == 1
            assert d.limits.max_message_bytes == 65536
            assert await health_status(ch) == NOT_SERVING

            rt.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, SyntheticOmni(), OMNI)
            rt.set_memory_provider(memory_report)
            rt.set_limits_provider(lambda: control_pb2.Limits(max_running_requests=7))
            rt.set_serving()
            assert await eventually_serving(ch)
            assert await health_status(ch, OMNI) == SERVING
            d = await control.Describe(control_pb2.DescribeRequest(), timeout=2)
            assert d.progress.phase == control_pb2.PHASE_SERVING
            assert d.limits.max_running_requests == 7
            assert [m.device for m in d.memory] == ["cpu"] and d.memory[0].total_bytes == 4 << 20
            assert await stop(rt) == 0
        rec = read_status(status_path(tmp_path, "alpha", 0))
        assert rec.phase == "stopped" and rec.pid == os.getpid()

    asyncio.run(scenario())


def test_drain_lets_in_flight_stream_finish_and_refuses_new_rpcs(tmp_path):
    async def scenario():
        async with running(tmp_path) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            stream = asyncio.create_task(collect(ch, "n=5 delay=0.1"))
            await wait_for_async(lambda: rt.in_flight == 1, 5, "stream in flight")
            drain = asyncio.ensure_future(
                control_pb2_grpc.ControlStub(ch).Drain(control_pb2.DrainRequest(deadline_ms=5000), timeout=10)
            )
            await wait_for_async(lambda: rt.phase == "draining", 5, "draining phase")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(ch, "n=1")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
            events = await stream
            assert [e.WhichOneof("event") for e in events] == ["text"] * 5 + ["finish"]
            reply = await drain
            assert (reply.completed, reply.aborted) == (1, 0)
            assert await health_status(ch) == NOT_SERVING
            d = await control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=2)
            assert d.progress.phase == control_pb2.PHASE_DRAINING

    asyncio.run(scenario())


def test_drain_deadline_cancels_the_rest(tmp_path):
    async def scenario():
        async with running(tmp_path) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            stream = asyncio.create_task(collect(ch, "n=1000 delay=0.05"))
            await wait_for_async(lambda: rt.in_flight == 1, 5, "stream in flight")
            reply = await control_pb2_grpc.ControlStub(ch).Drain(control_pb2.DrainRequest(deadline_ms=200), timeout=10)
            assert (reply.completed, reply.aborted) == (0, 1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream
            assert err.value.code() == grpc.StatusCode.CANCELLED and "drain deadline" in err.value.details()
            assert rt.in_flight == 0

    asyncio.run(scenario())


def test_errors_map_to_status_and_server_keeps_serving(tmp_path):
    async def scenario():
        async with running(tmp_path) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(ch, "raise")
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "synthetic handler bug" in err.value.details()

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(ch, "invalid")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(ch, "overloaded")
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("grpc-retry-pushback-ms", "250") in tuple(err.value.trailing_metadata())

            events = await collect(ch, "n=2")
            assert events[-1].finish.usage.completion_tokens == 2
            assert rt.in_flight == 0

    asyncio.run(scenario())


def test_message_size_limit_gives_resource_exhausted(tmp_path):
    async def scenario():
        async with running(tmp_path, max_message_bytes=4096) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(ch, "n=1 " + "x" * 8192)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(await collect(ch, "n=1")) == 2

    asyncio.run(scenario())


def test_reflection_lists_every_service(tmp_path):
    async def scenario():
        async with running(tmp_path) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            replies = [r async for r in stub.ServerReflectionInfo(iter([req]), timeout=5)]
            names = {s.name for s in replies[0].list_services_response.service}
        assert {OMNI, "omnistage.v1.Control", "grpc.health.v1.Health"} <= names

    asyncio.run(scenario())


def test_metrics_port_exports_phase_and_rpcs(tmp_path):
    port = free_port()

    def scrape() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    async def scenario():
        async with running(tmp_path, name="metrics_probe", metrics_port=port) as rt:
            async with grpc.aio.insecure_channel(rt.address) as ch:
                await collect(ch, "n=1")
            body = await asyncio.to_thread(scrape)
            assert 'omnistage_phase{phase="serving",rank="0",service="metrics_probe"} 1.0' in body
            assert 'omnistage_phase{phase="starting",rank="0",service="metrics_probe"} 0.0' in body
            assert 'omnistage_rpc_requests_total{code="OK",method="Generate",service="metrics_probe"} 1.0' in body
            assert await stop(rt) == 0
        with pytest.raises(OSError):
            await asyncio.to_thread(scrape)

    asyncio.run(scenario())


def test_port_in_use_is_an_error_naming_the_address(tmp_path):
    async def scenario():
        async with running(tmp_path, serving=False) as first:
            second = ServiceRuntime(first.cfg, first.svc, 0, port=first.port)
            with pytest.raises(OSError, match=f"cannot bind gRPC port 127.0.0.1:{first.port}"):
                await second.start()

    asyncio.run(scenario())


def test_fail_stops_with_exit_code_1(tmp_path):
    async def scenario():
        async with running(tmp_path) as rt:
            rt.fail("engine loop died")
            assert await asyncio.wait_for(rt.serve_until_stopped(), timeout=10) == 1
        rec = read_status(status_path(tmp_path, "alpha", 0))
        assert (rec.phase, rec.failure, rec.failed_in) == ("failed", "engine loop died", "serving")

    asyncio.run(scenario())
