"""Plumbing between grpc and our handlers: collecting generated handlers, dispatching by method path,
and decoding requests ourselves, so that bytes that are no valid message are a refusal (INVALID_ARGUMENT)
instead of grpc's UNKNOWN with a traceback in the log, and a request past its wire bounds
(wire_bounds.py) is refused before it is decoded at all."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor
from omnistage.common.runtime.wire_bounds import DEFAULT_MAX_RECORDS, WireBounds

BEHAVIORS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
# Requests at least this large are walked and decoded off the event loop (large_requests.py): their
# walk costs about a millisecond and more.
OFF_LOOP_BYTES = 16 << 10


class HandlerCollector:
    """Stands in for a grpc server so generated `add_*Servicer_to_server` functions hand us their handlers."""

    def __init__(self) -> None:
        self.methods: dict[str, grpc.RpcMethodHandler] = {}
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        for name, handler in handlers.items():
            self.methods[f"/{service}/{name}"] = handler


def collect(add_fn: Callable[[Any, Any], None], servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """`/package.Service/Method` → handler, as the generated add function registers them."""
    collector = HandlerCollector()
    add_fn(servicer, collector)
    return collector.methods


class Dispatcher(grpc.GenericRpcHandler):
    """Registered before the server starts, so services can be added after the port is bound."""

    def __init__(self) -> None:
        self.methods: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self.methods.get(handler_call_details.method)


@dataclass(frozen=True, slots=True)
class Received:
    """One request message as our deserializer hands it to the wrapper: decoded, or why not."""

    message: Any
    nbytes: int
    error: str = ""  # the bytes are no valid message
    refused: str = ""  # a wire bound passed (the message was not decoded)
    # A large request, not walked nor decoded yet: this does both (off the event loop), walking at
    # most `cost` records.
    later: Callable[[], Received] | None = None
    cost: int = 0


def decoding(handler: grpc.RpcMethodHandler, bounds: WireBounds | None = None) -> grpc.RpcMethodHandler:
    """The handler with a deserializer that never raises: it returns `Received` (the wrapper unpacks it).
    With `bounds`, the raw bytes are checked against them first. A request of `OFF_LOOP_BYTES` or more
    is only wrapped (`Received.later`): grpc calls this on the event loop."""
    deserialize = handler.request_deserializer

    max_records = bounds.max_records if bounds is not None else DEFAULT_MAX_RECORDS

    def safe(data: bytes) -> Received:
        if len(data) >= OFF_LOOP_BYTES:  # a record is at least two bytes
            cost = min(len(data) // 2, max_records)
            return Received(None, len(data), later=functools.partial(decode, data), cost=cost)
        return decode(data)

    def decode(data: bytes) -> Received:
        if bounds is not None:
            refused = bounds.refusal(data)
            if refused:
                return Received(None, len(data), refused=refused)
        try:
            message = deserialize(data) if deserialize is not None else data
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever a deserializer raises on bad bytes
            return Received(None, len(data), str(exc) or type(exc).__name__)
        return Received(message, len(data))

    return handler._replace(request_deserializer=safe)


def behavior_of(handler: grpc.RpcMethodHandler) -> tuple[str, Callable[..., Any]]:
    """(field name, callable) of the handler's one behaviour."""
    field = next(f for f in BEHAVIORS if getattr(handler, f) is not None)
    return field, getattr(handler, field)


def request_type(path: str) -> Descriptor | None:
    """`/omnistage.v1.Omni/Generate` → the GenerateRequest descriptor (from the descriptor pool); None
    for a method the pool does not know."""
    service, _, method = path.strip("/").rpartition("/")
    try:
        return descriptor_pool.Default().FindServiceByName(service).FindMethodByName(method).input_type
    except (KeyError, AttributeError):
        return None


def request_type_name(path: str) -> str:
    """`/omnistage.v1.Omni/Generate` → `omnistage.v1.GenerateRequest`."""
    descriptor = request_type(path)
    return descriptor.full_name if descriptor is not None else f"request of {path}"


async def unpack_stream(
    requests: AsyncIterator[Received], on_message: Callable[[Received], Awaitable[Received]]
) -> AsyncIterator[Any]:
    """The messages of a request stream; `on_message` decodes each one still undecoded and checks it
    (it raises for an undecodable one)."""
    async for received in requests:
        yield (await on_message(received)).message
