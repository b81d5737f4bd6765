"""Every RPC a service answers goes through `CallGuard.wrap`: the one place that decodes the request
(past its wire bounds or bad bytes → INVALID_ARGUMENT, the latter with one rate-limited log line), checks the API key, refuses stage RPCs
while draining, tracks them in flight, maps exceptions through the error table and counts in
metrics the status the client really got."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from omnistage.common import metrics
from omnistage.common.log import RateLimitedLog
from omnistage.common.runtime.auth import ApiKeys
from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable, Unauthenticated, status_for
from omnistage.common.runtime.handlers import (
    Received,
    behavior_of,
    decoding,
    request_type,
    request_type_name,
    unpack_stream,
)
from omnistage.common.runtime.large_requests import LargeRequests
from omnistage.common.runtime.memory_trim import MemoryTrimmer
from omnistage.common.runtime.wire_bounds import WireBounds

_log = logging.getLogger(__name__)
OK = grpc.StatusCode.OK
# Refusing a call whose client streams: how long its first message and then a pause between its
# messages may take, and the most time and bytes it is let send (dropped unread) before the status.
_FIRST_MESSAGE_S = 1.0
_QUIET_S = 0.25
_REFUSAL_WAIT_S = 3.0
_REFUSAL_BYTES = 8 << 20


@dataclass(eq=False)
class InFlight:
    """One running stage RPC (or tracked piece of work)."""

    method: str
    task: asyncio.Task | None
    started: float
    aborted: bool = False


class CallGuard:
    """Wraps handlers; holds the in-flight stage RPCs that Drain waits for and Describe counts."""

    def __init__(self, service: str, trimmer: MemoryTrimmer) -> None:
        self.service = service
        self.trimmer = trimmer
        # Why stage RPCs are refused now ('' while they are taken): "alpha is draining".
        self.refusal: Callable[[], str] = lambda: ""
        self.calls: set[InFlight] = set()
        self.finished = 0  # tracked calls that ended without being aborted
        self.idle = asyncio.Event()
        self.idle.set()
        self._bad_bytes_log = RateLimitedLog(_log)
        # Requests too large to walk and decode on the event loop (health must never wait for them).
        self.large = LargeRequests(service)

    # -- in flight ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def track(self, method: str) -> AsyncIterator[InFlight]:
        call = InFlight(method, asyncio.current_task(), time.monotonic())
        self.calls.add(call)
        self.idle.clear()
        metrics.rpc_in_flight().labels(self.service).inc()
        try:
            yield call
        finally:
            self.calls.discard(call)
            metrics.rpc_in_flight().labels(self.service).dec()
            self.finished += not call.aborted
            if not self.calls:
                self.idle.set()

    def abort_all(self) -> int:
        """Cancel every tracked call not aborted yet (a drain deadline passed); how many."""
        pending = [c for c in self.calls if not c.aborted]
        for call in pending:
            call.aborted = True
            if call.task is not None:
                call.task.cancel()
        return len(pending)

    # -- wrapping ----------------------------------------------------------------------------

    def wrap(
        self,
        path: str,
        handler: grpc.RpcMethodHandler,
        *,
        keys: ApiKeys | None,
        stage: bool,
        bounds: WireBounds | None = None,
    ) -> grpc.RpcMethodHandler:
        """`handler` behind the guard. `keys`: the API keys it needs (None: open). `stage`: a stage API
        method (refused while draining, tracked in flight, counted in metrics); else health, reflection
        or Control. `bounds`: the request's wire bounds (default: the record budget of its type)."""
        if bounds is None and (descriptor := request_type(path)) is not None:
            bounds = WireBounds(descriptor)
        handler = decoding(handler, bounds)
        field, behavior = behavior_of(handler)
        method = _Method(self, path, keys, stage, handler.request_streaming)
        if inspect.isasyncgenfunction(behavior) or inspect.isgeneratorfunction(behavior):
            wrapped = method.streaming(_async_stream(behavior))
        else:
            wrapped = method.unary(_async_unary(behavior))
        return handler._replace(**{field: wrapped})

    def observe(self, path: str, code: grpc.StatusCode, started: float) -> None:
        method = path.rsplit("/", 1)[-1]
        metrics.rpc_requests().labels(self.service, method, code.name).inc()
        metrics.rpc_latency().labels(self.service, method).observe(time.monotonic() - started)

    def undecodable(self, path: str, type_name: str, received: Received) -> InvalidRequest:
        self._bad_bytes_log.log(
            logging.WARNING,
            "undecodable request refused",
            method=path,
            bytes=received.nbytes,
            error=received.error,
        )
        return InvalidRequest(f"request is not a valid {type_name}: {received.error}")


def _async_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """Coroutine handlers as they are; a plain function (a generated UNIMPLEMENTED stub) called inline."""
    if inspect.iscoroutinefunction(behavior):
        return behavior

    async def call(request: Any, context: Any) -> Any:
        return behavior(request, context)

    return call


def _async_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        return behavior

    async def call(request: Any, context: Any) -> Any:
        for item in behavior(request, context):
            yield item

    return call


class _Method:
    """The guard of one method: admission before the handler, the status and its count after."""

    def __init__(
        self, guard: CallGuard, path: str, keys: ApiKeys | None, stage: bool, streaming_request: bool
    ):
        self.guard = guard
        self.path = path
        self.keys = keys
        self.stage = stage
        self.streaming_request = streaming_request
        self.type_name = request_type_name(path)

    def unary(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, token, nbytes = time.monotonic(), None, 0
            try:
                request, nbytes = await self.admit(request, context)
                async with self.tracked() as token:
                    result = await behavior(request, context)
            except BaseException as exc:
                request = None  # the abort's traceback keeps this frame: it must not keep the request
                await self.end(exc, token, context, started)
                raise
            finally:
                self.guard.trimmer.request_done(nbytes)
            if self.stage:
                self.guard.observe(self.path, OK, started)
            return result

        return call

    def streaming(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, token, nbytes = time.monotonic(), None, 0
            try:
                request, nbytes = await self.admit(request, context)
                async with self.tracked() as token:
                    async for item in behavior(request, context):
                        yield item
            except BaseException as exc:
                request = item = None  # the abort's traceback keeps this frame: it must not keep the request
                await self.end(exc, token, context, started)
                raise
            finally:
                self.guard.trimmer.request_done(nbytes)
            if self.stage:  # the last event went out and the stream completed
                self.guard.observe(self.path, OK, started)

        return call

    def tracked(self) -> contextlib.AbstractAsyncContextManager[InFlight | None]:
        return self.guard.track(self.path) if self.stage else contextlib.nullcontext()

    async def admit(self, request: Any, context: grpc.aio.ServicerContext) -> tuple[Any, int]:
        """(the request message or stream, its size); raises the refusal: no key, draining, bad bytes,
        too many large requests being decoded."""
        if self.keys is not None:
            why = self.keys.refusal(context.invocation_metadata())
            if why:
                await self.before_refusing(request)
                raise Unauthenticated(f"{self.path.strip('/').rsplit('/', 1)[0]}: {why}")
        if self.stage:
            why = self.guard.refusal()
            if why:
                await self.before_refusing(request)
                raise StageUnavailable(why)
        if self.streaming_request:
            return unpack_stream(request, self.check_stream_message), 0
        if request.later is not None:
            request = await self.guard.large.decoded(request, wait=False)
        if request.refused:
            raise InvalidRequest(request.refused)
        if request.error:
            raise self.guard.undecodable(self.path, self.type_name, request)
        return request.message, request.nbytes

    async def before_refusing(self, request: Any) -> None:
        """A client that streams its requests is let finish writing (what it sends is dropped unread)
        until it half-closes or falls quiet, at most `_REFUSAL_WAIT_S` and `_REFUSAL_BYTES`: a
        grpc.aio client whose write fails because our status came first reports INTERNAL instead of
        that status (grpc/grpc#36066; a wrong stage key on a bidirectional call read as INTERNAL)."""
        if not self.streaming_request:
            return
        deadline, nbytes, wait_s = time.monotonic() + _REFUSAL_WAIT_S, 0, _FIRST_MESSAGE_S
        requests = aiter(request)
        while nbytes < _REFUSAL_BYTES and (left := deadline - time.monotonic()) > 0:
            try:
                received = await within(anext(requests), min(left, wait_s))
            except (StopAsyncIteration, TimeoutError, grpc.RpcError, asyncio.InvalidStateError):
                return
            nbytes, wait_s = nbytes + received.nbytes, _QUIET_S

    async def check_stream_message(self, received: Received) -> Received:
        if received.later is not None:  # its call was admitted: it waits for room, never refused
            received = await self.guard.large.decoded(received, wait=True)
        if received.refused:
            raise InvalidRequest(received.refused)
        if received.error:
            raise self.guard.undecodable(self.path, self.type_name, received)
        self.guard.trimmer.request_done(received.nbytes)
        return received

    async def end(
        self, exc: BaseException, token: InFlight | None, context: grpc.aio.ServicerContext, started: float
    ) -> None:
        """Count the status the client gets for `exc`, then send it (raises AbortError) or let `exc` go on.

        The finished frames of `exc`'s traceback are cleared first: grpc keeps the last call's abort
        error (and with it this traceback) alive until the next call, and those frames hold the
        request, so a refused 60 MiB request would otherwise stay in memory.
        """
        traceback.clear_frames(exc.__traceback__)
        code, details, trailing = self.status(exc, token, context)
        if self.stage:
            self.guard.observe(self.path, code, started)
        if details is None:
            return
        if code == grpc.StatusCode.INTERNAL:
            _log.error("handler failed: %s", details, exc_info=exc)
        await context.abort(code, details, trailing_metadata=trailing)

    def status(
        self, exc: BaseException, token: InFlight | None, context: grpc.aio.ServicerContext
    ) -> tuple[grpc.StatusCode, str | None, tuple[tuple[str, str], ...]]:
        """(code, details to send or None when the status is already decided, trailing metadata)."""
        if isinstance(exc, asyncio.CancelledError) and token is not None and token.aborted:
            # Our drain deadline, not the client: tell the client why.
            return grpc.StatusCode.CANCELLED, f"{self.guard.service}: aborted, drain deadline passed", ()
        return status_of(exc, context)


def status_of(
    exc: BaseException, context: grpc.aio.ServicerContext
) -> tuple[grpc.StatusCode, str | None, tuple[tuple[str, str], ...]]:
    """The status a handler's exception gives the client: (code, details to send or None when the
    status is already decided, trailing metadata). A cancelled handler is CANCELLED, or
    DEADLINE_EXCEEDED when the client's deadline has passed."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return (grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED), None, ()
    if isinstance(exc, grpc.aio.AbortError):  # the handler chose its status itself
        return context.code() or grpc.StatusCode.UNKNOWN, None, ()
    if isinstance(exc, Exception):
        return status_for(exc)
    return grpc.StatusCode.UNKNOWN, None, ()
