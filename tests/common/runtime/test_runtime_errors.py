"""The one table from our exceptions to gRPC status, and the servicer decorator that applies it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from omnistage.common.runtime.errors import (
    CONTEXT_OVERFLOW,
    ERROR_REASON_KEY,
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    SimulatedOOM,
    StageUnavailable,
    grpc_errors,
    status_for,
)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidRequest("bad field"), grpc.StatusCode.INVALID_ARGUMENT),
        (StageUnavailable("thinker restarting"), grpc.StatusCode.UNAVAILABLE),
        (StageUnavailable("talker not deployed", retryable=False), grpc.StatusCode.FAILED_PRECONDITION),
        (Overloaded("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DeadlineExceeded("request deadline"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (SimulatedOOM("kv"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (KeyError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_table(exc, code):
    got, details, _ = status_for(exc)
    assert got == code
    assert str(exc).strip("'") in details


def test_overloaded_sends_retry_pushback():
    _, _, trailing = status_for(Overloaded("full", retry_after_ms=750))
    assert trailing == (("grpc-retry-pushback-ms", "750"),)
    assert status_for(InvalidRequest("x"))[2] == ()


def test_a_refusal_of_a_kind_says_its_kind_in_the_trailing_metadata():
    """The caller acts on the kind (Converse asks again with a shorter history), never on the words."""
    code, _, trailing = status_for(InvalidRequest("prompt: too long", reason=CONTEXT_OVERFLOW))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and trailing == ((ERROR_REASON_KEY, CONTEXT_OVERFLOW),)


def test_internal_names_the_exception_type():
    _, details, _ = status_for(ZeroDivisionError("division by zero"))
    assert details == "internal error: ZeroDivisionError: division by zero"


class FakeContext:
    """Records the abort a decorated method makes, raising like grpc.aio does."""

    def __init__(self) -> None:
        self.aborted: tuple | None = None

    async def abort(self, code, details, trailing_metadata=()):
        self.aborted = (code, details, tuple(trailing_metadata))
        raise grpc.aio.AbortError()


def test_decorator_maps_unary_and_stream_errors():
    class Servicer:
        @grpc_errors
        async def Unary(self, request, context):
            raise InvalidRequest(f"prompt: {request}")

        @grpc_errors
        async def Stream(self, request, context):
            yield 1
            raise Overloaded("busy", retry_after_ms=5)

        @grpc_errors
        async def Fine(self, request, context):
            return request * 2

    async def scenario():
        s = Servicer()
        ctx = FakeContext()
        with pytest.raises(grpc.aio.AbortError):
            await s.Unary("empty", ctx)
        assert ctx.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty", ())

        ctx = FakeContext()
        got = []
        with pytest.raises(grpc.aio.AbortError):
            async for item in s.Stream(None, ctx):
                got.append(item)
        assert got == [1]
        assert ctx.aborted == (grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("grpc-retry-pushback-ms", "5"),))

        assert await s.Fine(21, FakeContext()) == 42

    asyncio.run(scenario())


def test_decorator_lets_cancellation_through():
    @grpc_errors
    async def method(request, context):
        raise asyncio.CancelledError()

    ctx = FakeContext()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(method(None, ctx))
    assert ctx.aborted is None
