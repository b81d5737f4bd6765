"""OmniServicer: validate, run the request through the stages, stream events back.

The gateway holds no model. It turns a public request into stage calls (today: the thinker), passes
the client's deadline on, and cancels the stage stream when the client goes away.
"""

from __future__ import annotations

import grpc
from omnistage.common.runtime.errors import OmniError, Overloaded, StageUnavailable
from omnistage.services.gateway.media_path import check_media_paths
from omnistage.services.gateway.stages import ThinkerClient
from omnistage.services.gateway.validation import RequestLimits, plan_request
from omnistage.v1 import omni_pb2, omni_pb2_grpc, thinker_pb2


class StageError(OmniError):
    """A stage refused or failed a call: the client gets the stage's own status code and message."""

    def __init__(self, stage: str, exc: grpc.aio.AioRpcError) -> None:
        super().__init__(f"{stage}: {exc.details()}")
        self.code = exc.code()


def _event(request_id: str, ev: thinker_pb2.ThinkerEvent) -> omni_pb2.GenerateEvent | None:
    """The client's event for a thinker event (with the client's request_id); None for `started`,
    whose engine id stays inside (the gateway aborts by cancelling the stage stream)."""
    kind = ev.WhichOneof("event")
    if kind == "started":
        return None
    if kind == "delta":
        d = ev.delta
        return omni_pb2.GenerateEvent(
            request_id=request_id,
            text=omni_pb2.TextDelta(text=d.text, token_ids=d.token_ids, logprobs=d.logprobs),
        )
    f = ev.finish
    return omni_pb2.GenerateEvent(
        request_id=request_id, finish=omni_pb2.Finish(reason=f.reason, usage=f.usage, message=f.message)
    )


class OmniServicer(omni_pb2_grpc.OmniServicer):
    """The public API; one short method per RPC."""

    def __init__(
        self,
        thinker: ThinkerClient | None,
        deployed: set[str],
        *,
        max_concurrent_requests: int,
        limits: RequestLimits,
        system_prompt: str,
        media_dir: str = "",
    ) -> None:
        self.thinker = thinker
        self.deployed = deployed
        self.max_concurrent_requests = max_concurrent_requests
        self.limits = limits
        self.system_prompt = system_prompt
        self.media_dir = media_dir
        self.in_flight = 0

    async def Generate(self, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        check_media_paths(request, self.media_dir)  # a file path is a permission question, asked first
        plan = plan_request(request, self.deployed, self.system_prompt, self.limits)
        if self.thinker is None:
            raise StageUnavailable("the 'thinker' stage is not available (gateway started degraded)")
        if self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(f"gateway at its limit of {self.max_concurrent_requests} requests", retry_after_ms=200)
        self.in_flight += 1
        try:
            finished = False
            stream = self.thinker.generate(plan.request_id, plan.prompt, plan.sampling, context.time_remaining())
            try:
                async for ev in stream:
                    event = _event(plan.request_id, ev)
                    if event is not None:
                        yield event
                    if ev.WhichOneof("event") == "finish":
                        finished = True
                        break
            except grpc.aio.AioRpcError as exc:
                raise StageError("thinker", exc) from exc
            finally:
                await stream.aclose()
            if not finished:
                raise StageUnavailable("thinker: stream ended without a finish event")
        finally:
            self.in_flight -= 1

    async def Converse(self, request_iterator, context: grpc.aio.ServicerContext):
        raise StageUnavailable("Converse needs the 'talker' stage, which is not deployed", retryable=False)
        yield  # pragma: no cover - makes this an async generator (a streaming handler)
