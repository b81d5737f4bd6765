"""Wire bounds: a request past its counts is refused from its raw bytes, before protobuf builds it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import config_from_dict
from omnistage.common.runtime.errors import RETRY_PUSHBACK_KEY
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.wire_bounds import WireBounds
from omnistage.services.gateway.validation import (
    RequestLimits,
    plan_request,
    public_receive_bytes,
    wire_bounds,
)
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


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def packed(number: int, values: bytes) -> bytes:
    """A length-delimited record of field `number` holding `values` (a packed run)."""
    return _varint(number << 3 | 2) + _varint(len(values)) + values


def test_packed_numbers_count_as_their_values_bounded_by_byte_length():
    bounds = wire_bounds(RequestLimits())["Generate"]
    assert bounds.refusal(packed(3, b"\x01\x02\x01")) == ""  # output_modalities: 3 values
    assert bounds.refusal(packed(3, b"\x01" * 9)) == "output_modalities: more than 8 elements"
    # 8 values of two bytes each (16 bytes) pass: values are counted, not bytes
    assert bounds.refusal(packed(3, b"\x81\x01" * 8)) == ""
    assert bounds.refusal(packed(3, b"\x01" * 5) + packed(3, b"\x01" * 4)) == (
        "output_modalities: more than 8 elements"
    )  # two runs of one field add up
    # unpacked values of a repeated scalar count too (3 << 3 | 0: output_modalities as a varint)
    assert bounds.refusal(b"\x18\x01" * 9) == "output_modalities: more than 8 elements"
    sampling = packed(10, b"\x05" * 65)  # SamplingParams.stop_token_ids
    assert bounds.refusal(packed(4, sampling)) == "sampling.stop_token_ids: more than 64 elements"
    # a packed field without a limit of its own: each value is a record of the request's budget
    plain = WireBounds(omni_pb2.GenerateRequest.DESCRIPTOR, max_records=1000)
    assert plain.refusal(packed(3, b"\x01" * 1000)) == ""  # one record per value
    assert plain.refusal(packed(3, b"\x01" * 1001)) == "request: more than 1000 protobuf fields in all"
    assert plain.refusal(packed(3, b"\x01" * 60_000_000)) == "request: more than 1000 protobuf fields in all"


def test_groups_are_walked_through_not_a_way_around_the_bounds():
    """A group (wire type 3/4) ahead of the messages used to stop the walk; protobuf skips it as an
    unknown field, so the walk skips it too, counting its records, and goes on to the messages."""
    bounds = wire_bounds(RequestLimits(max_messages=4))["Generate"]
    group = b"\x43" + b"\x08\x01" * 3 + b"\x44"  # field 8 as a group holding three varints
    nested = b"\x43\x4b\x08\x01\x4c\x44"  # a group in a group
    for prefix in (group, nested):
        assert omni_pb2.GenerateRequest.FromString(prefix + many_parts(1, 1)).messages  # protobuf: skipped
        assert bounds.refusal(prefix + many_parts(1, 1)) == ""
        assert (
            bounds.refusal(prefix + EMPTY_MESSAGE * 5)
            == "messages: more than 4 elements (gateway.max_messages)"
        )
    small = WireBounds(omni_pb2.GenerateRequest.DESCRIPTOR, max_records=100)
    assert (
        small.refusal(b"\x43" + b"\x08\x01" * 200 + b"\x44")
        == "request: more than 100 protobuf fields in all"
    )
    # unbalanced groups are the parser's to refuse
    for bad in (b"\x43\x08\x01", b"\x44", b"\x43\x4c"):
        assert bounds.refusal(bad) == ""
        with pytest.raises(DecodeError):
            omni_pb2.GenerateRequest.FromString(bad)


def test_the_public_receive_limit_is_what_a_legitimate_request_carries():
    limits = RequestLimits()
    text_only = public_receive_bytes(limits, 0, 0)
    # the largest text a request may hold, in 4-byte characters, fits; 64 MiB of anything does not
    assert 4 * limits.max_prompt_chars < text_only < 4 << 20
    assert public_receive_bytes(limits, 32 << 20, 0) == text_only + (32 << 20)
    assert public_receive_bytes(limits, 32 << 20, 8 << 20) == text_only + (40 << 20)


@contextlib.asynccontextmanager
async def serving_runtime(
    tmp_path, servicer, bounds=None, **runtime_args
) -> AsyncIterator[tuple[ServiceRuntime, grpc.aio.Channel]]:
    """A gateway runtime serving `servicer` as Omni (with `bounds`), and a channel to it."""
    cfg = config_from_dict({"services": {"gw": {"kind": "gateway", "port": 1}}})
    rt = ServiceRuntime(cfg, cfg.service("gw"), 0, run_dir=tmp_path, port=0, metrics_port=0, **runtime_args)
    await rt.start()
    try:
        rt.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, servicer, OMNI, bounds=bounds)
        rt.set_serving()
        options = [("grpc.max_send_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(rt.address, options=options) as ch:
            yield rt, ch
    finally:
        rt.request_stop()
        await asyncio.wait_for(rt.serve_until_stopped(), 10)


@contextlib.asynccontextmanager
async def serving(tmp_path, servicer, bounds=None, **runtime_args) -> AsyncIterator[grpc.aio.Channel]:
    async with serving_runtime(tmp_path, servicer, bounds, **runtime_args) as (_, ch):
        yield ch


def raw_generate(ch: grpc.aio.Channel):
    return ch.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)


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
        servicer = _Recording()
        async with serving(tmp_path, servicer, wire_bounds(RequestLimits())) as ch:
            raw = raw_generate(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [e async for e in raw(EMPTY_MESSAGE * 8_000_000, timeout=60)]
            assert servicer.calls == 0 and parsed == []
            ok = [e async for e in raw(many_parts(1, 1), timeout=60)]
            assert len(ok) == 1 and servicer.calls == 1
            return err.value.code(), err.value.details(), len(parsed)

    code, details, parsed_after = asyncio.run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "messages: more than 256 elements (gateway.max_messages)"
    assert parsed_after == 1  # only the normal request was decoded


class _Validating(omni_pb2_grpc.OmniServicer):
    """Validates like the gateway (plan_request), then streams; the canary streams until told to stop."""

    def __init__(self) -> None:
        self.stop_canary = asyncio.Event()
        self.planned: list[str] = []

    async def Generate(self, request, context):
        plan = plan_request(request, {"thinker"}, "", RequestLimits())
        self.planned.append(plan.request_id)
        if plan.request_id != "canary":
            yield omni_pb2.GenerateEvent(request_id=plan.request_id)
            return
        while not self.stop_canary.is_set():
            yield omni_pb2.GenerateEvent(request_id="canary")
            await asyncio.sleep(0.01)
        for _ in range(3):  # still streaming after the bad request's answer
            yield omni_pb2.GenerateEvent(request_id="canary")


def test_a_packed_60mb_field_beside_a_canary_stream(tmp_path, monkeypatch):
    """The issue's probe: output_modalities packed with 60 M values next to a streaming request. The
    bad request is INVALID_ARGUMENT from its raw bytes (never decoded, planned or looped over); the
    canary, which began before it, goes on streaming after its answer and ends OK."""
    parsed: list[int] = []
    real = omni_pb2.GenerateRequest.FromString
    monkeypatch.setattr(
        omni_pb2.GenerateRequest, "FromString", lambda data: parsed.append(len(data)) or real(data)
    )
    text = omni_pb2.GenerateRequest(
        request_id="bad", messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER)]
    )
    text.messages[0].parts.add(text="hi")
    bad = text.SerializeToString() + packed(3, b"\x01" * 60_000_000)
    canary = omni_pb2.GenerateRequest(request_id="canary")
    canary.messages.add(role=omni_pb2.ROLE_USER).parts.add(text="hi")

    async def main() -> list[str]:
        servicer = _Validating()
        order: list[str] = []
        async with serving(tmp_path, servicer, wire_bounds(RequestLimits())) as ch:
            stream = omni_pb2_grpc.OmniStub(ch).Generate(canary, timeout=60)
            await stream.read()
            order.append("canary streaming")

            async def canary_rest() -> None:
                while await stream.read() is not grpc.aio.EOF:
                    order.append("canary event")
                order.append(f"canary {(await stream.code()).name}")

            rest = asyncio.create_task(canary_rest())
            try:
                [e async for e in raw_generate(ch)(bad, timeout=60)]
                order.append("bad OK")
            except grpc.aio.AioRpcError as exc:
                order.append(f"bad {exc.code().name}: {exc.details()}")
            servicer.stop_canary.set()
            await asyncio.wait_for(rest, 30)
        assert servicer.planned == ["canary"]  # the bad request never reached validation
        assert len(parsed) == 1 and parsed[0] < 1000  # nor the parser: only the canary was decoded
        return order

    order = asyncio.run(main())
    answered = order.index("bad INVALID_ARGUMENT: output_modalities: more than 8 elements")
    assert order[0] == "canary streaming" and order[-1] == "canary OK"
    assert order[answered + 1 : -1].count("canary event") >= 3  # it kept streaming after the answer


def test_the_main_port_receives_at_most_its_receive_limit(tmp_path):
    """A runtime given a receive limit below max_message_bytes (the gateway's public API) refuses a
    larger request with RESOURCE_EXHAUSTED before it is handled; one within it is served."""

    async def main() -> tuple[grpc.StatusCode, int]:
        servicer = _Recording()
        async with serving(tmp_path, servicer, max_receive_bytes=1 << 20) as ch:
            big = omni_pb2.GenerateRequest(request_id="r", system_prompt="x" * (2 << 20))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [e async for e in raw_generate(ch)(big.SerializeToString(), timeout=60)]
            [e async for e in raw_generate(ch)(many_parts(1, 1), timeout=60)]
            return err.value.code(), servicer.calls

    assert asyncio.run(main()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 1)


class _HeldWalks:
    """WireBounds.refusal of large requests held until released (at most 30 s), and the threads
    the walks ran on."""

    def __init__(self, monkeypatch) -> None:
        self.release, self.walking, self.threads = threading.Event(), threading.Event(), []
        real = WireBounds.refusal

        def refusal(bounds, data):
            if len(data) >= 1 << 20:
                self.threads.append(threading.current_thread().name)
                self.walking.set()
                self.release.wait(30)
            return real(bounds, data)

        monkeypatch.setattr(WireBounds, "refusal", refusal)


def _big(request_id: str) -> bytes:
    return omni_pb2.GenerateRequest(
        request_id=request_id, system_prompt="x" * (1200 << 10)
    ).SerializeToString()


async def _answer(call) -> str:
    try:
        events = [e async for e in call]
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return f"OK {omni_pb2.GenerateEvent.FromString(events[0]).request_id}"


def test_a_large_request_is_walked_off_the_event_loop_and_health_answers_meanwhile(tmp_path, monkeypatch):
    """Issue 43: 120 requests of 99,999 records each held a gateway's event loop 9.6 s (the walk is
    Python): its health went unanswered and the launcher took it for hung. Now health is answered
    while a large request's walk is under way, which runs on a thread of its own."""
    held = _HeldWalks(monkeypatch)

    async def main() -> list[str]:
        order = []
        async with serving(tmp_path, _Recording(), wire_bounds(RequestLimits())) as ch:
            big = asyncio.ensure_future(_answer(raw_generate(ch)(_big("big"), timeout=60)))
            await asyncio.get_running_loop().run_in_executor(None, held.walking.wait, 30)
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            order.append(health_pb2.HealthCheckResponse.ServingStatus.Name(health.status))
            order.append(f"big done: {big.done()}")
            held.release.set()
            order.append(await big)
        return order

    assert asyncio.run(main()) == ["SERVING", "big done: False", "OK big"]
    assert held.threads and all(name.startswith("gw-decode") for name in held.threads)


def test_large_requests_past_the_walk_budget_are_resource_exhausted_with_a_retry_hint(tmp_path, monkeypatch):
    """At most LargeRequests.max_records (estimated from the sizes: a record is at least two bytes,
    a request at most its record budget) in the walk at once, a lone request always: the next one is
    refused at arrival, RESOURCE_EXHAUSTED with grpc-retry-pushback-ms, and served once there is room."""
    held = _HeldWalks(monkeypatch)

    async def main():
        async with serving_runtime(tmp_path, _Recording(), wire_bounds(RequestLimits())) as (rt, ch):
            rt.calls.large.max_records = 150_000  # each of these requests may cost 100,000
            first = asyncio.ensure_future(_answer(raw_generate(ch)(_big("first"), timeout=60)))
            await asyncio.get_running_loop().run_in_executor(None, held.walking.wait, 30)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [e async for e in raw_generate(ch)(_big("second"), timeout=60)]
            held.release.set()
            again = await _answer(raw_generate(ch)(_big("second"), timeout=60))
            return refused.value, await first, again

    refused, first, again = asyncio.run(main())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details().startswith(
        "gw: 1 large requests (1.2 MiB, up to 100000 protobuf fields) are being decoded, at most 150000"
    )
    assert int(dict(refused.trailing_metadata())[RETRY_PUSHBACK_KEY]) > 0
    assert (first, again) == ("OK first", "OK second")
