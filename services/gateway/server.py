"""OmniServicer: the public API; each RPC hands its request to the Pipeline, reads its run's events and
counts what it sends."""

from __future__ import annotations

import contextlib
import time

import grpc
from omnistage.services.gateway.converse import Conversation, ConverseLimits
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.request_metrics import GatewayMetrics
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc


class OmniServicer(omni_pb2_grpc.OmniServicer):
    """The public API; one short method per RPC."""

    def __init__(self, pipeline: Pipeline, converse: ConverseLimits = ConverseLimits()) -> None:
        self.pipeline = pipeline
        self.converse = converse
        self.metrics = GatewayMetrics(pipeline.service)

    async def Generate(self, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrived_at = time.monotonic()
        with self.metrics.call("Generate", request, context, arrived_at) as call:
            run = await self.pipeline.generate(request, context, arrived_at)
            async with run, contextlib.aclosing(run.events()) as events:  # closing cancels its stages now
                async for event in events:
                    call.sent(event)
                    yield event

    async def Tokenize(self, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        return await self.pipeline.tokenize(request, context)

    async def Detokenize(self, request: common_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        return await self.pipeline.detokenize(request, context)

    async def Converse(self, request_iterator, context: grpc.aio.ServicerContext):
        conversation = Conversation(self.pipeline, context, self.converse)
        with self.metrics.call("Converse", None, context, time.monotonic()) as call:
            async with contextlib.aclosing(conversation.events(request_iterator)) as events:
                async for event in events:
                    call.sent(event)
                    yield event
