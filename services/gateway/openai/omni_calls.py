"""The front's Omni Generate calls on the gateway's own port: opened (refused before any event: an
HttpError), read to their end, several at once (`n` choices), cancelled when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
from omnistage.common.client import Result
from omnistage.common.runtime.deadlines import cancel_and_wait, within
from omnistage.services.gateway.openai.errors import HttpError, from_grpc
from omnistage.services.gateway.openai.omni_params import ParamMap
from omnistage.v1 import omni_pb2, omni_pb2_grpc
from starlette.requests import Request


@dataclass
class Opened:
    """A call that answered with its first event; `params` names the body's field of a refusal."""

    call: grpc.aio.UnaryStreamCall
    first: omni_pb2.GenerateEvent
    params: Callable[[str], str | None] | None = None


def metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The Omni call's metadata: the client's API key (`Authorization`)."""
    value = request.headers.get("authorization")
    return (("authorization", value),) if value else ()


def rpc_error(exc: grpc.aio.AioRpcError, params: Callable[[str], str | None] | None = None) -> HttpError:
    return from_grpc(exc.code(), exc.details(), exc.trailing_metadata(), params)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (call once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OmniCalls:
    """Generate calls through `stub`, each with the deadline `timeout_s`. After an answer's finish its
    call may take `finished_stream_end_s` to end by itself (status OK) before it is cancelled."""

    def __init__(self, stub: omni_pb2_grpc.OmniStub, timeout_s: float, finished_stream_end_s: float) -> None:
        self.stub = stub
        self.timeout_s = timeout_s
        self.finished_stream_end_s = finished_stream_end_s

    async def open(
        self, request: Request, omni: omni_pb2.GenerateRequest, params: ParamMap | None = None
    ) -> Opened:
        """The call with its first event; HttpError when it is refused before any event."""
        call = self.stub.Generate(omni, timeout=self.timeout_s, metadata=metadata(request))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, params) from None
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise HttpError(502, "the gateway's stream ended without an event", type="server_error")
        return Opened(call, first, params)

    async def open_choices(
        self, request: Request, requests: Sequence[omni_pb2.GenerateRequest], params: ParamMap
    ) -> list[Opened]:
        """Each choice's call: the first alone, the others once its prompt is computed (its first event:
        they then share the prompt's KV through the thinker's prefix cache); a refusal of any cancels
        those opened."""
        opened = [await self.open(request, requests[0], params)]
        if len(requests) == 1:
            return opened
        try:
            rest = await asyncio.gather(
                *(self.open(request, r, params) for r in requests[1:]), return_exceptions=True
            )
        except BaseException:  # this task is cancelled (each open cancels its own call)
            opened[0].call.cancel()
            raise
        failed = [r for r in rest if isinstance(r, BaseException)]
        opened += [r for r in rest if not isinstance(r, BaseException)]
        if failed:
            for one in opened:
                one.call.cancel()
            raise failed[0]
        return opened

    async def events(self, opened: Opened) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """The first event, then the rest; an RPC error becomes HttpError; the call ends with it. Left
        after the finish, the call gets its own end (OK) first; left before, it is cancelled (the client
        went away: the stages stop)."""
        finished = False
        call = opened.call
        try:
            event = opened.first
            while event is not grpc.aio.EOF:
                finished = finished or event.WhichOneof("event") == "finish"
                yield event
                event = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, opened.params) from None
        finally:
            try:
                if finished:
                    with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                        await within(call.code(), self.finished_stream_end_s)
            finally:
                call.cancel()  # a no-op on a call that ended

    async def collect(
        self, request: Request, omni: omni_pb2.GenerateRequest, params: ParamMap | None = None
    ) -> Result:
        """The whole answer of one call."""
        return (await self.collect_all(request, [await self.open(request, omni, params)]))[0]

    async def collect_all(self, request: Request, opened: list[Opened]) -> list[Result]:
        """The whole answers of opened calls. A client that disconnects meanwhile cancels them (an image
        or a long answer is not made for nobody); the first failure of one cancels the others."""
        collected = [Result() for _ in opened]

        async def fill(result: Result, one: Opened) -> None:
            async for event in self.events(one):
                result.add(event)

        async def gather() -> None:
            try:
                async with asyncio.TaskGroup() as group:
                    for result, one in zip(collected, opened, strict=True):
                        group.create_task(fill(result, one))
            except ExceptionGroup as failed:
                raise failed.exceptions[0] from None

        work, gone = asyncio.ensure_future(gather()), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            left = not work.done()  # the client went away (or this task is being cancelled)
            if left:
                for one in opened:
                    one.call.cancel()
                await cancel_and_wait([work], self.finished_stream_end_s, "openai front: a left answer")
        if left:
            raise HttpError(499, "the client went away", type="cancelled", code="cancelled")
        work.result()  # an RPC error as HttpError
        if any(result.finish is None for result in collected):
            raise HttpError(502, "the gateway's stream ended without a finish event", type="server_error")
        return collected
