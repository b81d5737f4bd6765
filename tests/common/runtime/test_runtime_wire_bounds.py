"""Wire bounds: a request past its counts is refused from its raw bytes, before protobuf builds it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from omnistage.common.config import config_from_dict
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.wire_bounds import WireBounds
from omnistage.services.gateway.validation import RequestLimits, wire_bounds
from omnistage.v1 import omni_pb2, omni_pb2_grpc

OMNI = "omnistage.v1.Omni"
GENERATE = f"/{OMNI}/Generate"
EMPTY_MESSAGE = b"\x12\x00"  # GenerateRequest.messages (field 2), an empty ChatMessage


def many_parts(messages: int, parts: int) -> bytes:
    req = omni_pb2.GenerateRequest(request_id="r")
    for _ in range(messages):
        msg = req.messages.add(role=omni_pb2.ROLE_USER)
        for _ in range(parts):
            msg.parts.add(text="hi")
    return req.SerializeToString()


def test_counts_per_field_and_per_parent():
    bounds = wire_bounds(RequestLimits(max_messages=4, max_parts_per_message=3))["Generate"]
    assert bounds.refusal(many_parts(4, 3)) == ""
    assert bounds.refusal(many_parts(5, 1)) == "messages: more than 4 elements (gateway.max_messages)"
    # parts are counted in each message, not over the request
    assert (
        bounds.refusal(many_parts(2, 4))
        == "messages.parts: more than 3 elements (gateway.max_parts_per_message)"
    )
    converse = wire_bounds(RequestLimits(max_messages=4))["Converse"]
    config = omni_pb2.ConverseRequest(config=omni_pb2.GenerateRequest.FromString(many_parts(5, 1)))
    assert (
        converse.refusal(config.SerializeToString())
        == "config.messages: more than 4 elements (gateway.max_messages)"
    )


def test_the_record_budget_bounds_any_field_even_a_repeated_singular_one():
    bounds = WireBounds(omni_pb2.GenerateRequest.DESCRIPTOR, max_records=1000)
    assert (
        bounds.refusal(b"\x0a\x00" * 1001) == "request: more than 1000 protobuf fields in all"
    )  # request_id x 1001
    assert bounds.refusal(b"\x0a\x00" * 1000) == ""


def test_large_bytes_are_skipped_and_bad_bytes_left_to_the_parser():
    bounds = wire_bounds(RequestLimits())["Generate"]
    req = omni_pb2.GenerateRequest()
    req.messages.add().parts.add().image.data = b"\x12\x00" * 100_000  # looks like messages, is bytes
    assert bounds.refusal(req.SerializeToString()) == ""
    for garbage in (b"\xff\xff\xff\xff", b"\x12\xff\xff\xff\xff\x0f", b"\x12\x05ab"):
        assert bounds.refusal(garbage) == ""


class _Recording(omni_pb2_grpc.OmniServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        yield omni_pb2.GenerateEvent(request_id=request.request_id)


def test_a_request_past_its_bounds_never_reaches_the_parser_or_the_handler(tmp_path, monkeypatch):
    """8 M empty messages (16 MB): INVALID_ARGUMENT naming the bound; the handler and the deserializer
    never run, and a normal request on the same port is served after it."""
    parsed: list[int] = []
    real = omni_pb2.GenerateRequest.FromString
    monkeypatch.setattr(
        omni_pb2.GenerateRequest, "FromString", lambda data: parsed.append(len(data)) or real(data)
    )

    async def main() -> tuple[grpc.StatusCode, str, int]:
        cfg = config_from_dict({"services": {"gw": {"kind": "gateway", "port": 1}}})
        rt = ServiceRuntime(cfg, cfg.service("gw"), 0, run_dir=tmp_path, port=0, metrics_port=0)
        await rt.start()
        servicer = _Recording()
        try:
            rt.add_servicer(
                omni_pb2_grpc.add_OmniServicer_to_server, servicer, OMNI, bounds=wire_bounds(RequestLimits())
            )
            rt.set_serving()
            options = [("grpc.max_send_message_length", 64 << 20)]
            async with grpc.aio.insecure_channel(rt.address, options=options) as ch:
                raw = ch.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [e async for e in raw(EMPTY_MESSAGE * 8_000_000, timeout=60)]
                assert servicer.calls == 0 and parsed == []
                ok = [e async for e in raw(many_parts(1, 1), timeout=60)]
                assert len(ok) == 1 and servicer.calls == 1
                return err.value.code(), err.value.details(), len(parsed)
        finally:
            rt.request_stop()
            await asyncio.wait_for(rt.serve_until_stopped(), 10)

    code, details, parsed_after = asyncio.run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "messages: more than 256 elements (gateway.max_messages)"
    assert parsed_after == 1  # only the normal request was decoded
