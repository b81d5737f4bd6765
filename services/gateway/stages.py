"""Typed clients of the stage services, as the gateway uses them.

Deadlines propagate (the client's remaining time bounds every stage call) and a cancelled client
cancels the stage stream, which aborts the request inside the stage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.runtime.errors import StageUnavailable
from omnistage.v1 import common_pb2, control_pb2, control_pb2_grpc, thinker_pb2, thinker_pb2_grpc


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class StageClient:
    """A channel to one stage service plus its health and Control stubs."""

    def __init__(self, name: str, address: str, max_message_bytes: int) -> None:
        self.name = name
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.control = control_pb2_grpc.ControlStub(self.channel)

    async def wait_serving(self, timeout_s: float, poll_s: float = 0.2) -> control_pb2.DescribeResponse:
        """Wait until the stage is SERVING; on timeout say which phase it is stuck in."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                status = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    return await self.control.Describe(control_pb2.DescribeRequest(), timeout=2.0)
                desc = await self.control.Describe(control_pb2.DescribeRequest(), timeout=2.0)
                p = desc.progress
                last = f"phase {control_pb2.Phase.Name(p.phase)} {p.done}/{p.total} {p.unit}".strip()
            except grpc.aio.AioRpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            await asyncio.sleep(poll_s)
        raise StageUnavailable(f"stage '{self.name}' at {self.address} not SERVING after {timeout_s:.0f}s ({last})")

    async def close(self) -> None:
        await self.channel.close()


class ThinkerClient(StageClient):
    """Thinker.Generate as an async iterator of events, bounded by the caller's deadline."""

    def __init__(self, name: str, address: str, max_message_bytes: int) -> None:
        super().__init__(name, address, max_message_bytes)
        self.stub = thinker_pb2_grpc.ThinkerStub(self.channel)

    async def generate(
        self,
        request_id: str,
        prompt: thinker_pb2.ChatPrompt,
        sampling: common_pb2.SamplingParams,
        timeout_s: float | None,
    ) -> AsyncIterator[thinker_pb2.ThinkerEvent]:
        """The thinker's events, `started` first. `request_id` is the client's, for the thinker's logs."""
        call = self.stub.Generate(
            thinker_pb2.ThinkerRequest(request_id=request_id, chat=prompt, sampling=sampling), timeout=timeout_s
        )
        try:
            async for event in call:
                yield event
        finally:
            # Client gone, deadline hit or the consumer stopped early: cancelling the stream makes the
            # thinker abort the request and free its KV blocks.
            call.cancel()

    async def abort(self, engine_request_id: str) -> bool:
        """Abort by the engine id of the stream's `started` event (no other id aborts anything)."""
        resp = await self.stub.Abort(thinker_pb2.AbortRequest(request_id=engine_request_id), timeout=5.0)
        return resp.aborted
