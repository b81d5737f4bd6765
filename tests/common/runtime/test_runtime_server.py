"""ServiceRuntime in process: health follows the phase, Describe, Drain/Resume on the admin port only,
limits, errors, reflection (v1 and v1alpha), metrics."""

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
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.status_file import read_status, status_path
from omnistage.v1 import (
    control_pb2,
    control_pb2_grpc,
    grpc_reflection_v1_pb2,
    grpc_reflection_v1_pb2_grpc,
    omni_pb2,
    omni_pb2_grpc,
)

from tests.common.runtime.synthetic_stage import SyntheticOmni, free_port, memory_report
from tests.waits import wait_for_async

OMNI = "omnistage.v1.Omni"
CONTROL = "omnistage.v1.Control"
HEALTH = "grpc.health.v1.Health"
REFLECTION = {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def make_runtime(tmp_path, name="alpha", metrics_port=0, **svc) -> ServiceRuntime:
    svc = {
        "kind": "thinker",
        "port": 1,
        "admin_port": free_port(),
        "max_message_bytes": 65536,
        "drain_grace_s": 2.0,
        **svc,
    }
    cfg = config_from_dict({"services": {name: svc}})
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
        if not rt.stop_requested:
            await stop(rt)


async def health_status(channel, service: str = "") -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=2
    )
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


def control_of(channel) -> control_pb2_grpc.ControlStub:
    return control_pb2_grpc.ControlStub(channel)


def test_health_follows_phase_and_describe_reports_progress(tmp_path):
    async def scenario():
        async with (
            running(tmp_path, serving=False) as rt,
            grpc.aio.insecure_channel(rt.address) as ch,
            grpc.aio.insecure_channel(rt.admin_address) as admin,
        ):
            control = control_of(admin)
            assert await health_status(ch) == NOT_SERVING
            d = await control.Describe(control_pb2.DescribeRequest(), timeout=2)
            assert d.progress.phase == control_pb2.PHASE_STARTING

            rt.reporter.enter("loading_weights", total=3, unit="shards")
            rt.reporter.advance(detail="shard-00001")
            d = await control.Describe(control_pb2.DescribeRequest(), timeout=2)
            assert (d.progress.phase, d.progress.done, d.progress.total) == (
                control_pb2.PHASE_LOADING_WEIGHTS,
                1,
                3,
            )
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
            assert await health_status(admin) == SERVING
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
        async with (
            running(tmp_path) as rt,
            grpc.aio.insecure_channel(rt.address) as ch,
            grpc.aio.insecure_channel(rt.admin_address) as admin,
        ):
            stream = asyncio.create_task(collect(ch, "n=5 delay=0.1"))
            await wait_for_async(lambda: rt.in_flight == 1, 5, "stream in flight")
            drain = asyncio.ensure_future(
                control_of(admin).Drain(control_pb2.DrainRequest(deadline_ms=5000), timeout=10)
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
            assert await health_status(ch, OMNI) == NOT_SERVING
            d = await control_of(admin).Describe(control_pb2.DescribeRequest(), timeout=2)
            assert d.progress.phase == control_pb2.PHASE_DRAINING and d.progress.detail == "Control.Drain"
        assert read_status(status_path(tmp_path, "alpha", 0)).phase == "stopped"

    asyncio.run(scenario())


def test_drain_deadline_cancels_the_rest(tmp_path):
    async def scenario():
        async with (
            running(tmp_path) as rt,
            grpc.aio.insecure_channel(rt.address) as ch,
            grpc.aio.insecure_channel(rt.admin_address) as admin,
        ):
            stream = asyncio.create_task(collect(ch, "n=1000 delay=0.05"))
            await wait_for_async(lambda: rt.in_flight == 1, 5, "stream in flight")
            reply = await control_of(admin).Drain(control_pb2.DrainRequest(deadline_ms=200), timeout=10)
            assert (reply.completed, reply.aborted) == (0, 1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream
            assert err.value.code() == grpc.StatusCode.CANCELLED and "drain deadline" in err.value.details()
            assert rt.in_flight == 0

    asyncio.run(scenario())


def test_drain_then_resume_serves_again(tmp_path):
    async def scenario():
        async with (
            running(tmp_path) as rt,
            grpc.aio.insecure_channel(rt.address) as ch,
            grpc.aio.insecure_channel(rt.admin_address) as admin,
        ):
            await control_of(admin).Drain(control_pb2.DrainRequest(deadline_ms=1000), timeout=10)
            assert read_status(status_path(tmp_path, "alpha", 0)).phase == "draining"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(ch, "n=1")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            reply = await control_of(admin).Resume(control_pb2.ResumeRequest(), timeout=5)
            assert reply.phase == control_pb2.PHASE_SERVING
            assert await eventually_serving(ch)
            assert [e.WhichOneof("event") for e in await collect(ch, "n=1")] == ["text", "finish"]
            rec = read_status(status_path(tmp_path, "alpha", 0))
            assert (rec.phase, rec.detail) == ("serving", "Control.Resume")
            with pytest.raises(grpc.aio.AioRpcError) as err:  # nothing to resume now
                await control_of(admin).Resume(control_pb2.ResumeRequest(), timeout=5)
            assert (
                err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                and "not draining" in err.value.details()
            )

    asyncio.run(scenario())


def test_resume_during_a_drain_ends_the_wait_without_cancelling(tmp_path):
    async def scenario():
        async with (
            running(tmp_path) as rt,
            grpc.aio.insecure_channel(rt.address) as ch,
            grpc.aio.insecure_channel(rt.admin_address) as admin,
        ):
            stream = asyncio.create_task(collect(ch, "n=20 delay=0.05"))
            await wait_for_async(lambda: rt.in_flight == 1, 5, "stream in flight")
            drain = asyncio.ensure_future(
                control_of(admin).Drain(control_pb2.DrainRequest(deadline_ms=30000), timeout=60)
            )
            await wait_for_async(lambda: rt.phase == "draining", 5, "draining phase")
            await control_of(admin).Resume(control_pb2.ResumeRequest(), timeout=5)
            reply = await asyncio.wait_for(drain, 10)
            assert reply.aborted == 0
            assert (await stream)[-1].WhichOneof("event") == "finish"

    asyncio.run(scenario())


def test_a_stop_cannot_be_resumed_and_drain_needs_a_serving_service(tmp_path):
    async def scenario():
        async with (
            running(tmp_path, serving=False) as rt,
            grpc.aio.insecure_channel(rt.address) as ch,
            grpc.aio.insecure_channel(rt.admin_address) as admin,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:  # still starting
                await control_of(admin).Drain(control_pb2.DrainRequest(), timeout=5)
            assert (
                err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                and "phase starting" in err.value.details()
            )
            rt.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, SyntheticOmni(), OMNI)
            rt.set_serving()
            stream = asyncio.create_task(collect(ch, "n=20 delay=0.05"))  # keeps the stop's drain waiting
            await wait_for_async(lambda: rt.in_flight == 1, 5, "stream in flight")
            rt.request_stop()  # what SIGTERM does
            stopping = asyncio.create_task(rt.serve_until_stopped())
            await wait_for_async(lambda: rt.phase == "draining", 5, "stopping")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await control_of(admin).Resume(control_pb2.ResumeRequest(), timeout=5)
            assert (
                err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                and "cannot be resumed" in err.value.details()
            )
            assert (await stream)[-1].WhichOneof("event") == "finish"
            assert await asyncio.wait_for(stopping, 10) == 0

    asyncio.run(scenario())


def test_control_is_not_served_on_the_main_port(tmp_path):
    async def scenario():
        async with running(tmp_path) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            for call in (
                control_of(ch).Drain(control_pb2.DrainRequest(), timeout=5),
                control_of(ch).Describe(control_pb2.DescribeRequest(), timeout=5),
                control_of(ch).Resume(control_pb2.ResumeRequest(), timeout=5),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert rt.phase == "serving"
            assert await health_status(ch) == SERVING

    asyncio.run(scenario())


def test_without_an_admin_port_there_is_no_control_at_all(tmp_path):
    async def scenario():
        async with running(tmp_path, admin_port=0) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            assert rt.admin_address == ""
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await control_of(ch).Drain(control_pb2.DrainRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

    asyncio.run(scenario())


def test_admin_key_is_required_for_every_control_call(tmp_path, monkeypatch):
    monkeypatch.setenv("ALPHA_ADMIN_KEY", "s3cret-admin")

    async def scenario():
        async with (
            running(tmp_path, admin_api_key_env="ALPHA_ADMIN_KEY") as rt,
            grpc.aio.insecure_channel(rt.admin_address) as admin,
        ):
            control = control_of(admin)
            wanted = "the admin key (services.alpha.admin_api_key_env)"  # which credential, never its value
            for metadata, why in [
                ((), f"missing credentials: this port takes {wanted}, sent as 'authorization: Bearer <key>'"),
                ((("authorization", "Bearer wrong"),), f"invalid key: this port takes {wanted}"),
                ((("authorization", "s3cret-admin"),), f"malformed credentials: send {wanted} as"),
            ]:
                for call in (
                    control.Drain(control_pb2.DrainRequest(), timeout=5, metadata=metadata),
                    control.Describe(control_pb2.DescribeRequest(), timeout=5, metadata=metadata),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and why in err.value.details()
                    assert "s3cret" not in err.value.details()
            assert rt.phase == "serving"
            good = (("authorization", "Bearer s3cret-admin"),)
            d = await control.Describe(control_pb2.DescribeRequest(), timeout=5, metadata=good)
            assert d.name == "alpha"
            assert await health_status(admin) == SERVING  # health stays open

    asyncio.run(scenario())


def test_api_keys_guard_the_stage_api_and_leave_health_open(tmp_path, monkeypatch):
    keys = tmp_path / "keys.txt"
    keys.write_text("# clients\nkey-from-file\n")
    monkeypatch.setenv("FRONT_KEYS", "key-a, key-b")

    async def scenario():
        async with (
            running(
                tmp_path, name="front", kind="gateway", api_keys_env="FRONT_KEYS", api_keys_file=str(keys)
            ) as rt,
            grpc.aio.insecure_channel(rt.address) as ch,
        ):
            stub = omni_pb2_grpc.OmniStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(ch, "n=1")
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert err.value.details() == (
                "omnistage.v1.Omni: missing credentials: this port takes the API key "
                "(services.front.api_keys_env + services.front.api_keys_file), sent as 'authorization: Bearer "
                "<key>' (gRPC metadata; over HTTP the header 'Authorization: Bearer <key>')"
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [
                    e
                    async for e in stub.Generate(
                        request("n=1"), timeout=5, metadata=(("authorization", "Bearer key-c"),)
                    )
                ]
            assert (
                err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                and "invalid key: this port takes the API key (services.front" in err.value.details()
                and "key-" not in err.value.details()
            )
            for key in ("key-a", "key-b", "key-from-file"):
                events = [
                    e
                    async for e in stub.Generate(
                        request("n=1"), timeout=5, metadata=(("authorization", f"Bearer {key}"),)
                    )
                ]
                assert events[-1].WhichOneof("event") == "finish"
            assert await health_status(ch) == SERVING

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
        async with (
            running(tmp_path, max_message_bytes=4096) as rt,
            grpc.aio.insecure_channel(rt.address) as ch,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(ch, "n=1 " + "x" * 8192)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(await collect(ch, "n=1")) == 2

    asyncio.run(scenario())


async def listed(channel, v1: bool) -> set[str]:
    pb2, grpc_mod = (
        (grpc_reflection_v1_pb2, grpc_reflection_v1_pb2_grpc) if v1 else (reflection_pb2, reflection_pb2_grpc)
    )
    stub = grpc_mod.ServerReflectionStub(channel)
    req = pb2.ServerReflectionRequest(list_services="")
    replies = [r async for r in stub.ServerReflectionInfo(iter([req]), timeout=5)]
    return {s.name for s in replies[0].list_services_response.service}


def test_reflection_v1_and_v1alpha_list_exactly_what_each_port_serves(tmp_path):
    async def scenario():
        async with (
            running(tmp_path) as rt,
            grpc.aio.insecure_channel(rt.address) as ch,
            grpc.aio.insecure_channel(rt.admin_address) as admin,
        ):
            for v1 in (True, False):
                assert await listed(ch, v1) == {OMNI, HEALTH, *REFLECTION}
                assert await listed(admin, v1) == {CONTROL, HEALTH, *REFLECTION}
            stub = grpc_reflection_v1_pb2_grpc.ServerReflectionStub(ch)
            req = grpc_reflection_v1_pb2.ServerReflectionRequest(file_containing_symbol=OMNI)
            (reply,) = [r async for r in stub.ServerReflectionInfo(iter([req]), timeout=5)]
            assert reply.file_descriptor_response.file_descriptor_proto
            assert reply.original_request.file_containing_symbol == OMNI

    asyncio.run(scenario())


def test_health_answers_for_control_on_the_admin_port_and_each_stage_api_on_the_main_port(tmp_path):
    async def scenario():
        async with (
            running(tmp_path, serving=False) as rt,
            grpc.aio.insecure_channel(rt.address) as ch,
            grpc.aio.insecure_channel(rt.admin_address) as admin,
        ):
            assert await health_status(admin, CONTROL) == SERVING  # Control answers in every phase
            assert await health_status(admin) == NOT_SERVING
            rt.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, SyntheticOmni(), OMNI)
            rt.set_serving()
            assert await eventually_serving(ch)
            assert await health_status(ch, OMNI) == SERVING
            for channel, missing in ((ch, CONTROL), (admin, OMNI)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health_status(channel, missing)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND

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
            assert (
                'omnistage_rpc_requests_total{code="OK",method="Generate",service="metrics_probe"} 1.0'
                in body
            )
            assert await stop(rt) == 0
        with pytest.raises(OSError):
            await asyncio.to_thread(scrape)

    asyncio.run(scenario())


def test_port_in_use_is_an_error_naming_the_key_and_address(tmp_path):
    async def scenario():
        async with running(tmp_path, serving=False) as first:
            second = ServiceRuntime(first.cfg, first.svc, 0, port=first.port, admin_port=0)
            with pytest.raises(OSError, match=f"services.alpha.port: cannot bind 127.0.0.1:{first.port}"):
                await second.start()
            third = ServiceRuntime(first.cfg, first.svc, 0, port=0, admin_port=first.admin_port)
            with pytest.raises(
                OSError, match=f"services.alpha.admin_port: cannot bind 127.0.0.1:{first.admin_port}"
            ):
                await third.start()

    asyncio.run(scenario())


def test_fail_stops_with_exit_code_1(tmp_path):
    async def scenario():
        async with running(tmp_path) as rt:
            rt.fail("engine loop died")
            assert await asyncio.wait_for(rt.serve_until_stopped(), timeout=10) == 1
        rec = read_status(status_path(tmp_path, "alpha", 0))
        assert (rec.phase, rec.failure, rec.failed_in) == ("failed", "engine loop died", "serving")

    asyncio.run(scenario())


def test_an_internal_service_bound_beyond_loopback_logs_a_warning(tmp_path, caplog):
    async def scenario():
        async with running(tmp_path, bind_host="0.0.0.0") as rt:
            assert rt.address.startswith("127.0.0.1:")  # dialed at `host`
        async with running(tmp_path, name="front", kind="gateway", bind_host="0.0.0.0"):
            pass

    import logging

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    warnings = [r for r in caplog.records if "listens beyond this host" in r.getMessage()]
    assert len(warnings) == 1 and "services.alpha.bind_host" in str(warnings[0].__dict__.get("fields"))
