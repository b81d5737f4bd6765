"""Our exceptions and the one table that turns them into gRPC status codes.

Servicers raise these (or anything else); `grpc_errors` / `abort_with` answer the client with the
mapped status, so a bug in a handler is an INTERNAL error for one RPC, never a dead server.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc

_log = logging.getLogger(__name__)

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
# Trailing metadata of an INVALID_ARGUMENT that says what kind of refusal it is (a caller acts on the
# kind, never on the message's words): CONTEXT_OVERFLOW, the prompt (with the room its answer asks
# for) does not fit the model's context, where a shorter prompt may; NOTHING_TO_SPEAK, a Speak stream's
# text had nothing the talker speaks (a stream moved to another talker for the rest of an answer whose
# rest has none: its speech is complete).
ERROR_REASON_KEY = "omnistage-error-reason"
CONTEXT_OVERFLOW = "context_overflow"
NOTHING_TO_SPEAK = "nothing_to_speak"


class OmniError(Exception):
    """Base of the errors a service reports to its client on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequest(OmniError):
    """The request itself is wrong; retrying it unchanged cannot help. `reason` says what kind of
    refusal it is (ERROR_REASON_KEY), when a caller can act on it."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str = "", *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class Unauthenticated(OmniError):
    """No credentials, or wrong ones (API key, admin key)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(OmniError):
    """The caller may not do this (a Media.path outside the gateway's media directory)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(OmniError):
    """Not possible in the service's current state (Resume of a service that is not draining)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StageUnavailable(OmniError):
    """A stage cannot take the request: UNAVAILABLE when it may come back, else FAILED_PRECONDITION."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable

    @property
    def code(self) -> grpc.StatusCode:  # type: ignore[override]
        return grpc.StatusCode.UNAVAILABLE if self.retryable else grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(OmniError):
    """Queue full: the client should back off `retry_after_ms` (sent as grpc-retry-pushback-ms)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, retry_after_ms: int = 100, reason: str = "") -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms
        self.reason = reason  # the refusal's kind for metrics (`gateway_full`, `thinker_deadline`, ...)


class DeadlineExceeded(OmniError):
    """The request's deadline passed inside the service."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class SimulatedOOM(MemoryError):
    """Raised by the test-only fault hook (`fault.action: oom`) in place of a real device OOM."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The (code, details, trailing metadata) a client gets for `exc`."""
    if isinstance(exc, Overloaded):
        return exc.code, str(exc), ((RETRY_PUSHBACK_KEY, str(max(0, int(exc.retry_after_ms)))),)
    if isinstance(exc, InvalidRequest) and exc.reason:
        return exc.code, str(exc), ((ERROR_REASON_KEY, exc.reason),)
    if isinstance(exc, OmniError):
        return exc.code, str(exc), ()
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out: {exc}" if str(exc) else "timed out", ()
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, f"not implemented: {exc}" if str(exc) else "not implemented", ()
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {exc}", ()
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", ()


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status mapped from `exc` (raises grpc.aio.AbortError, as context.abort does)."""
    code, details, trailing = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        _log.error("handler failed: %s", details, exc_info=exc)
    await context.abort(code, details, trailing_metadata=trailing)


def _passthrough(exc: BaseException) -> bool:
    # AbortError: the handler already chose a status; CancelledError: the RPC is gone.
    return isinstance(exc, grpc.aio.AbortError | asyncio.CancelledError)


def grpc_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an aio servicer method (coroutine or async generator) to apply the error table."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(*args: Any) -> Any:
            context = args[-1]
            try:
                async for item in fn(*args):
                    yield item
            except Exception as exc:
                if _passthrough(exc):
                    raise
                await abort_with(context, exc)

        return stream

    @functools.wraps(fn)
    async def unary(*args: Any) -> Any:
        context = args[-1]
        try:
            return await fn(*args)
        except Exception as exc:
            if _passthrough(exc):
                raise
            await abort_with(context, exc)

    return unary
