"""Typed clients of the stage services, as the gateway uses them.

Deadlines propagate (the client's remaining time bounds every stage call) and a cancelled client
cancels the stage stream, which aborts the request inside the stage.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from omnistage.common.runtime import auth
from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.errors import CONTEXT_OVERFLOW, ERROR_REASON_KEY, OmniError, StageUnavailable
from omnistage.v1 import (
    common_pb2,
    control_pb2,
    control_pb2_grpc,
    encoder_pb2,
    encoder_pb2_grpc,
    imagegen_pb2,
    imagegen_pb2_grpc,
    talker_pb2,
    talker_pb2_grpc,
    thinker_pb2,
    thinker_pb2_grpc,
)

# After its last event (finish, image, `finished`) a stage stream ends at once; this bounds the wait
# for its status.
FINISHED_STREAM_END_S = 5.0


async def take_end(call: grpc.aio.Call) -> None:
    """After a stream's last event: wait (bounded) for the call's own end (status OK) instead of
    cancelling it, which the stage would count (and log) as a client cancel."""
    with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
        await within(call.code(), FINISHED_STREAM_END_S)


class StageError(OmniError):
    """A stage refused or failed a call: the client gets the stage's own status code and message."""

    def __init__(self, stage: str, exc: grpc.aio.AioRpcError, details: str | None = None) -> None:
        super().__init__(f"{stage}: {exc.details() if details is None else details}")
        self.code = exc.code()
        # The refusal's kind, when the stage gave one (errors.py's ERROR_REASON_KEY): acted on, never
        # the message's words.
        self.reason = str(dict(exc.trailing_metadata() or ()).get(ERROR_REASON_KEY, ""))

    @property
    def context_overflow(self) -> bool:
        """The stage refused the prompt as too long for its context (with the room its answer asks
        for), not the request's own max_tokens: a shorter prompt may fit."""
        return self.code == grpc.StatusCode.INVALID_ARGUMENT and self.reason == CONTEXT_OVERFLOW


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Message bounds, HTTP/2 keepalive pings so that a stage host that vanished (no FIN, no RST)
    ends the gateway's calls on it instead of leaving them open until their deadlines, and reconnect
    attempts at most 1 s apart, so a restarted stage is reached as soon as it listens (grpc's default
    backoff grows to minutes)."""
    return [
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


# grpc's details when a batch fails in the client (a write into a connection the peer broke, e.g. a
# stage that died under a streaming call before its watch noticed): not the stage's own status.
CORE_INTERNAL = "Internal error from Core"


def broken_stream(exc: grpc.aio.AioRpcError) -> bool:
    """The call failed in this client because its connection broke: the stage is unavailable."""
    return exc.code() == grpc.StatusCode.INTERNAL and exc.details() == CORE_INTERNAL


class StageClient:
    """A channel to one stage service's main port (its API and health), and Describe on its admin port."""

    def __init__(
        self,
        name: str,
        address: str,
        max_message_bytes: int,
        *,
        admin_address: str = "",
        admin_metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.name = name
        self.address = address
        self.max_message_bytes = max_message_bytes
        # Every call presents the deployment's stage key (auth.py), when it has one.
        self.channel = grpc.aio.insecure_channel(
            address, options=channel_options(max_message_bytes), interceptors=auth.stage_interceptors()
        )
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.admin_address = admin_address
        self.admin_metadata = admin_metadata
        self.admin_channel = (
            grpc.aio.insecure_channel(admin_address, interceptors=auth.stage_interceptors())
            if admin_address
            else None
        )
        self.control = control_pb2_grpc.ControlStub(self.admin_channel) if self.admin_channel else None
        # Why the stage cannot take calls now ("" while it is SERVING); set by its StageWatch.
        self.down_reason = ""
        # Its StageWatch's: a call found the stage unreachable (see `unreachable`).
        self.on_unreachable: Callable[[str], None] | None = None
        self._calls: set[grpc.aio.Call] = set()

    @property
    def up(self) -> bool:
        return not self.down_reason

    def unavailable(self) -> StageUnavailable:
        """The error of a call the stage cannot take now (UNAVAILABLE naming the stage and why)."""
        return StageUnavailable(f"stage '{self.name}' is unavailable: {self.down_reason or 'unknown'}")

    def check_up(self) -> None:
        if self.down_reason:
            raise self.unavailable()

    def unreachable(self, why: str) -> None:
        """A call got UNAVAILABLE (a replica killed, its port refusing) before the watch's health checks
        noticed: the watch takes the stage out now, so that no new call goes to it (a replica with no
        calls in flight is the least loaded), and admits it again once it answers SERVING."""
        if self.up and self.on_unreachable is not None:
            self.on_unreachable(why)

    def track(self, call: grpc.aio.Call) -> grpc.aio.Call:
        """Remember `call` until it ends, so that a stage found down fails it at once (`lose_calls`)."""
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        return call

    def lose_calls(self) -> int:
        """The stage went down: cancel every call in flight on it (their callers see `down_reason`)."""
        calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()
        return len(calls)

    def lost_call(self) -> bool:
        """In an `except CancelledError` of a call: True when the watch cancelled the call because the
        stage went down (grpc.aio raises CancelledError for a locally cancelled call), False when the
        caller's own task is being cancelled."""
        task = asyncio.current_task()
        return bool(self.down_reason) and not (task is not None and task.cancelling())

    @contextlib.contextmanager
    def lost_as_unavailable(self) -> Iterator[None]:
        """Around a call's use: a call the watch cancelled (the stage went down) is UNAVAILABLE naming
        the stage, not a bare cancellation."""
        try:
            yield
        except asyncio.CancelledError:
            if self.lost_call():
                raise self.unavailable() from None
            raise

    async def stream(
        self, open_call: Callable[[], grpc.aio.UnaryStreamCall], last: str
    ) -> AsyncIterator[Any]:
        """The events of the streaming call `open_call` makes once the stage is up (tracked). After its
        `last` event kind the call's own end (OK) is taken instead of cancelling it; a consumer that
        stops early (client gone, deadline) cancels it, which aborts the request inside the stage (a
        no-op on a stream that ended)."""
        self.check_up()
        call = self.track(open_call())
        finished = False
        try:
            with self.lost_as_unavailable():
                async for event in call:
                    finished = finished or event.WhichOneof("event") == last
                    yield event
        finally:
            if finished:
                await take_end(call)
            call.cancel()

    @property
    def calls_in_flight(self) -> int:
        return len(self._calls)

    def error(self, exc: grpc.aio.AioRpcError) -> OmniError:
        """The client's error for a failed call: UNAVAILABLE naming the stage when it went down under
        the call, else the stage's own status."""
        if self.down_reason and exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
            return self.unavailable()
        if broken_stream(exc):
            return StageUnavailable(f"stage '{self.name}' is unavailable: the stream broke ({exc.details()})")
        return StageError(self.name, exc)

    async def describe(self) -> control_pb2.DescribeResponse | None:
        """The stage's Describe, or None when it has no admin port."""
        if self.control is None:
            return None
        return await self.control.Describe(
            control_pb2.DescribeRequest(), timeout=2.0, metadata=self.admin_metadata
        )

    async def close(self) -> None:
        await self.channel.close()
        if self.admin_channel is not None:
            await self.admin_channel.close()


class ThinkerClient(StageClient):
    """Thinker.Generate as an async iterator of events, bounded by the caller's deadline."""

    def __init__(self, name: str, address: str, max_message_bytes: int, **admin: Any) -> None:
        super().__init__(name, address, max_message_bytes, **admin)
        self.stub = thinker_pb2_grpc.ThinkerStub(self.channel)

    def generate(
        self,
        request_id: str,
        prompt: thinker_pb2.ChatPrompt,
        sampling: common_pb2.SamplingParams,
        timeout_s: float | None,
        multimodal: list[thinker_pb2.MultimodalEmbedding] | None = None,
        hidden_states: thinker_pb2.HiddenStatesRequest | None = None,
    ) -> AsyncIterator[thinker_pb2.ThinkerEvent]:
        """The thinker's events, `started` first. `request_id` is the client's, for the thinker's logs;
        `multimodal` carries the encoder's refs as they came (the thinker releases their leases);
        `hidden_states` asks for the image query block's hidden states instead of tokens. Leaving early
        cancels the stream: the thinker aborts the request and frees its KV blocks."""
        request = thinker_pb2.ThinkerRequest(
            request_id=request_id,
            chat=prompt,
            sampling=sampling,
            multimodal=multimodal or [],
            hidden_states=hidden_states,
        )
        return self.stream(lambda: self.stub.Generate(request, timeout=timeout_s), "finish")

    async def tokenize(
        self, request: thinker_pb2.TokenizeRequest, timeout_s: float | None
    ) -> common_pb2.TokenizeResponse:
        return await self._unary(self.stub.Tokenize(request, timeout=timeout_s))

    async def detokenize(
        self, request: common_pb2.DetokenizeRequest, timeout_s: float | None
    ) -> common_pb2.DetokenizeResponse:
        return await self._unary(self.stub.Detokenize(request, timeout=timeout_s))

    async def _unary(self, call: Any) -> Any:
        self.check_up()
        call = self.track(call)
        try:
            with self.lost_as_unavailable():
                return await call
        except grpc.aio.AioRpcError as exc:
            raise self.error(exc) from exc


class EncoderClient(StageClient):
    """Encoder.Encode bounded by the caller's deadline (a cancelled caller cancels the call, and the
    encoder takes back the leases of a response it could not hand over)."""

    def __init__(self, name: str, address: str, max_message_bytes: int, **admin: Any) -> None:
        super().__init__(name, address, max_message_bytes, **admin)
        self.stub = encoder_pb2_grpc.EncoderStub(self.channel)

    async def encode(
        self, request: encoder_pb2.EncodeRequest, timeout_s: float | None
    ) -> encoder_pb2.EncodeResponse:
        self.check_up()
        call = self.track(self.stub.Encode(request, timeout=timeout_s))
        try:
            with self.lost_as_unavailable():
                return await call
        except grpc.aio.AioRpcError as exc:
            if self.down_reason:
                raise self.unavailable() from exc
            raise


class TalkerClient(StageClient):
    """Talker.Speak calls, and the credits for them: the gateway holds at most the talker's stress-tested
    number of streams (`limits.max_running_requests` of its Describe; unknown: no local limit)."""

    def __init__(self, name: str, address: str, max_message_bytes: int, **admin: Any) -> None:
        super().__init__(name, address, max_message_bytes, **admin)
        self.stub = talker_pb2_grpc.TalkerStub(self.channel)
        self.max_streams = 0  # 0: unknown

    async def read_limits(self) -> None:
        desc = await self.describe()
        if desc is not None:
            self.max_streams = desc.limits.max_running_requests

    def has_credit(self) -> bool:
        """A credit is a Speak call not over yet (tracked; the only calls this client tracks)."""
        return not self.max_streams or self.calls_in_flight < self.max_streams

    def speak(
        self,
        requests: AsyncIterable[talker_pb2.SpeakRequest] | Iterable[talker_pb2.SpeakRequest],
        timeout_s: float | None,
    ) -> grpc.aio.StreamStreamCall:
        """An open Speak call that sends `requests` (read by a task of grpc's, their only reader) and is
        read for speech. It holds a credit until it is over (finished, failed or cancelled): counted
        from the calls themselves, so no path can leak one.

        The caller ends `requests` on every path (an iterator that runs out, or a flag its owner sets;
        never aclose() from another task): grpc cancels its reading task only when the call is
        cancelled while live, so a call the talker ended (finished, refused, failed) leaves it waiting
        for the next request. Not the write()/done_writing() style: through the stage key's
        interceptors grpc makes those its own queue-fed generator, which nothing ends once the talker
        ended the call first; its task and generator were left to the GC ("Task was destroyed but it
        is pending!", "aclose(): asynchronous generator is already running")."""
        return self.track(self.stub.Speak(requests, timeout=timeout_s))


class ImageGenClient(StageClient):
    """ImageGen.Generate as an async iterator of events, bounded by the caller's deadline; leaving
    early (client gone, deadline) cancels the call, which stops the denoising at the next step."""

    def __init__(self, name: str, address: str, max_message_bytes: int, **admin: Any) -> None:
        super().__init__(name, address, max_message_bytes, **admin)
        self.stub = imagegen_pb2_grpc.ImageGenStub(self.channel)
        # What it denoises at once and lets wait (its Describe, read when it is admitted; 0: unknown).
        self.max_running = 0
        self.max_waiting = 0

    def generate(
        self, request: imagegen_pb2.ImageGenRequest, timeout_s: float | None
    ) -> AsyncIterator[imagegen_pb2.ImageGenEvent]:
        return self.stream(lambda: self.stub.Generate(request, timeout=timeout_s), "image")
