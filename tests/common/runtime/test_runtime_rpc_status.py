"""The status a client gets is the status the metrics count, and undecodable bytes are a clean refusal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from omnistage.common import metrics
from omnistage.common.config import config_from_dict
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.v1 import omni_pb2, omni_pb2_grpc
from prometheus_client import generate_latest

from tests.common.runtime.synthetic_stage import SyntheticOmni
from tests.waits import wait_for_async

OMNI = "omnistage.v1.Omni"
GENERATE = f"/{OMNI}/Generate"


@contextlib.asynccontextmanager
async def serving(tmp_path, name: str) -> AsyncIterator[ServiceRuntime]:
    cfg = config_from_dict({"services": {name: {"kind": "thinker", "port": 1, "drain_grace_s": 2.0}}})
    rt = ServiceRuntime(cfg, cfg.service(name), 0, run_dir=tmp_path, port=0, metrics_port=0)
    await rt.start()
    try:
        rt.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, SyntheticOmni(), OMNI)
        rt.set_serving()
        yield rt
    finally:
        rt.request_stop()
        await asyncio.wait_for(rt.serve_until_stopped(), timeout=10)


def counted(service: str) -> dict[tuple[str, str], float]:
    """(method, code) → count of omnistage_rpc_requests_total for `service`, read from the /metrics text."""
    out = {}
    for line in generate_latest(metrics.REGISTRY).decode().splitlines():
        if line.startswith("omnistage_rpc_requests_total{") and f'service="{service}"' in line:
            labels = dict(
                part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            key = (labels["method"].strip('"'), labels["code"].strip('"'))
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def request(text: str) -> omni_pb2.GenerateRequest:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=text)])
    return omni_pb2.GenerateRequest(request_id="r1", messages=[msg])


async def status_of(channel, text: str, timeout: float = 10) -> grpc.StatusCode:
    try:
        async for _ in omni_pb2_grpc.OmniStub(channel).Generate(request(text), timeout=timeout):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("n=2", "OK"),
        ("invalid", "INVALID_ARGUMENT"),
        ("overloaded", "RESOURCE_EXHAUSTED"),
        ("raise", "INTERNAL"),
    ],
)
def test_metrics_count_the_status_the_client_got(tmp_path, text, code):
    name = f"count_{code.lower()}"

    async def scenario():
        async with serving(tmp_path, name) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            assert (await status_of(ch, text)).name == code
            await wait_for_async(lambda: rt.in_flight == 0, 5, "call finished")
        assert counted(name) == {("Generate", code): 1.0}

    asyncio.run(scenario())


def test_a_deadline_counts_deadline_exceeded_and_a_cancel_counts_cancelled(tmp_path):
    name = "count_deadline_cancel"

    async def scenario():
        async with serving(tmp_path, name) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            assert await status_of(ch, "n=1000 delay=0.05", timeout=0.3) == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_for_async(lambda: rt.in_flight == 0, 5, "deadline call finished")
            call = omni_pb2_grpc.OmniStub(ch).Generate(request("n=1000 delay=0.05"), timeout=30)
            async for _ in call:
                break
            call.cancel()
            await wait_for_async(lambda: rt.in_flight == 0, 5, "cancelled call finished")
        assert counted(name) == {("Generate", "DEADLINE_EXCEEDED"): 1.0, ("Generate", "CANCELLED"): 1.0}

    asyncio.run(scenario())


def test_a_refusal_while_draining_counts_unavailable_under_its_method(tmp_path):
    name = "count_draining"

    async def scenario():
        async with serving(tmp_path, name) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            await rt.drain(0.1)
            assert await status_of(ch, "n=1") == grpc.StatusCode.UNAVAILABLE
        assert counted(name) == {("Generate", "UNAVAILABLE"): 1.0}

    asyncio.run(scenario())


def test_undecodable_bytes_get_invalid_argument_and_one_log_line(tmp_path, caplog):
    name = "count_undecodable"
    garbage = [b"\xff\xff\xff\xff", b"\x0a\x05abc", b"\x12\xff\xff\xff\xff\x0f"]

    async def scenario():
        async with serving(tmp_path, name) as rt, grpc.aio.insecure_channel(rt.address) as ch:
            raw = ch.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
            for data in garbage:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in raw(data, timeout=10):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith("request is not a valid omnistage.v1.GenerateRequest: ")
            assert await status_of(ch, "n=1") == grpc.StatusCode.OK  # and the service goes on
        assert counted(name) == {("Generate", "INVALID_ARGUMENT"): 3.0, ("Generate", "OK"): 1.0}

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a client's bad bytes"
    lines = [r for r in caplog.records if "undecodable" in r.getMessage() or "DecodeError" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # rate-limited: one line for the burst


@pytest.mark.parametrize(
    "path",
    [
        "/grpc.health.v1.Health/Check",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ],
)
def test_undecodable_bytes_to_health_and_reflection_are_refused_too(tmp_path, path):
    async def scenario():
        async with serving(tmp_path, "undecodable_open") as rt, grpc.aio.insecure_channel(rt.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if "Reflection" in path:  # a request stream: the bad message is the first of the stream
                    call = ch.stream_stream(path, request_serializer=None, response_deserializer=None)
                    [r async for r in call(iter([b"\xff\xff\xff"]), timeout=10)]
                else:
                    await ch.unary_unary(path, request_serializer=None, response_deserializer=None)(
                        b"\xff\xff", timeout=10
                    )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("request is not a valid grpc.")

    asyncio.run(scenario())
