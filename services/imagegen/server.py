"""ImageGenServicer: proto in → request flow → proto events out. No model or scheduling logic here."""

from __future__ import annotations

import grpc
from omnistage.services.imagegen.request_flow import ImageGenEngine, ImageResult, Progress
from omnistage.v1 import imagegen_pb2, imagegen_pb2_grpc


class ImageGenServicer(imagegen_pb2_grpc.ImageGenServicer):
    def __init__(self, engine: ImageGenEngine) -> None:
        self.engine = engine

    async def Generate(self, request: imagegen_pb2.ImageGenRequest, context: grpc.aio.ServicerContext):
        parsed = await self.engine.parse(request)
        async for ev in self.engine.generate(parsed, timeout_s=context.time_remaining()):
            yield _event(ev)


def _event(ev: Progress | ImageResult) -> imagegen_pb2.ImageGenEvent:
    if isinstance(ev, Progress):
        return imagegen_pb2.ImageGenEvent(
            progress=imagegen_pb2.ImageGenProgress(step=ev.step, total_steps=ev.total)
        )
    return imagegen_pb2.ImageGenEvent(
        image=imagegen_pb2.ImageGenImage(
            png=ev.png,
            width=ev.width,
            height=ev.height,
            seed=ev.seed,
            generated_width=ev.bucket[1],
            generated_height=ev.bucket[0],
            steps=ev.steps,
        )
    )
