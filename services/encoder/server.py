"""EncoderServicer: proto in → engine call → proto out. No media or model logic here.

Field errors name the item (`items[2].kind: ...`); the engine names the item of any media error.
"""

from __future__ import annotations

import grpc
import torch
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.transport import TransportError, decode
from omnistage.services.encoder.items import MediaItem
from omnistage.services.encoder.request_flow import EncodedOutput, EncoderEngine
from omnistage.v1 import encoder_pb2, encoder_pb2_grpc

_KINDS = {
    encoder_pb2.MEDIA_KIND_IMAGE: "image",
    encoder_pb2.MEDIA_KIND_AUDIO: "audio",
    encoder_pb2.MEDIA_KIND_VIDEO: "video",
}
_PROTO_KINDS = {v: k for k, v in _KINDS.items()}
_SOURCES = {"image": ("data",), "audio": ("data", "samples"), "video": ("data", "frames")}


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, engine: EncoderEngine) -> None:
        self.engine = engine

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        items = [self._item(i, item) for i, item in enumerate(request.items)]
        outputs = await self.engine.encode(
            items,
            timeout_s=context.time_remaining(),
            consumer_host_id=request.consumer_host_id,
            allow_cuda_ipc=request.allow_cuda_ipc,
        )
        try:
            return encoder_pb2.EncodeResponse(
                items=[_encoded(o) for o in outputs],
                spatial_merge_size=self.engine.models.config.vision.spatial_merge_size,
            )
        except BaseException:
            self.engine.revoke(outputs)
            raise

    def _item(self, i: int, item: encoder_pb2.EncodeItem) -> MediaItem:
        kind = _KINDS.get(item.kind)
        if kind is None:
            raise InvalidRequest(
                f"items[{i}].kind: set MEDIA_KIND_IMAGE, MEDIA_KIND_AUDIO or MEDIA_KIND_VIDEO"
            )
        source = item.WhichOneof("source")
        if source is None:
            raise InvalidRequest(f"items[{i}]: set one of {', '.join(_SOURCES[kind])}")
        if source not in _SOURCES[kind]:
            raise InvalidRequest(
                f"items[{i}].{source}: not accepted for a {kind} item (use {', '.join(_SOURCES[kind])})"
            )
        if source == "data":
            return MediaItem(kind, data=item.data)
        if source == "frames":
            if not item.frames.images:
                raise InvalidRequest(f"items[{i}].frames.images: at least one frame is required")
            return MediaItem(kind, frames=tuple(item.frames.images), fps=item.frames.fps)
        return MediaItem(kind, samples=self._samples(i, item), sample_rate_hz=item.sample_rate_hz)

    def _samples(self, i: int, item: encoder_pb2.EncodeItem):
        if item.sample_rate_hz == 0:
            raise InvalidRequest(f"items[{i}].sample_rate_hz: required with samples")
        try:
            t = decode(item.samples, transport=self.engine.transport)
        except (TransportError, ValueError) as exc:
            raise InvalidRequest(f"items[{i}].samples: {exc}") from None
        if t.dtype == torch.int16:  # PCM16 as a client sent it (a Converse turn): scaled to [-1, 1)
            return (t.to(torch.float32) / 32768.0).numpy()
        if not t.is_floating_point():
            raise InvalidRequest(
                f"items[{i}].samples: expected float samples in [-1, 1] or int16 PCM, got {t.dtype}"
            )
        return t.to(torch.float32).numpy()


def _encoded(o: EncodedOutput) -> encoder_pb2.EncodedItem:
    return encoder_pb2.EncodedItem(
        kind=_PROTO_KINDS[o.kind],
        embeddings=o.ref,
        num_tokens=o.num_tokens,
        placeholder_token_id=o.placeholder_token_id,
        merged_grids=[encoder_pb2.GridTHW(t=t, h=h, w=w) for t, h, w in o.merged_grids],
        timestamps_s=list(o.timestamps_s),
        duration_s=o.duration_s,
        resized_height=o.resized[0],
        resized_width=o.resized[1],
    )
