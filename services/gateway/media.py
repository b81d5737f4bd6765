"""A request's media parts → one Encoder.Encode call → what the prompt and the thinker need."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from pathlib import Path

import grpc
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.transport import TransportContext
from omnistage.common.transport.release import release_quietly
from omnistage.services.gateway.stages import EncoderClient, StageError
from omnistage.services.gateway.validation import MediaPart
from omnistage.v1 import encoder_pb2, thinker_pb2

_KIND = {
    "image": encoder_pb2.MEDIA_KIND_IMAGE,
    "audio": encoder_pb2.MEDIA_KIND_AUDIO,
    "video": encoder_pb2.MEDIA_KIND_VIDEO,
}
_ITEM = re.compile(r"^items\[(\d+)\](?: \((?:image|audio|video)\))?")
# Room kept in an Encode message for everything but the media bytes.
MESSAGE_OVERHEAD = 64 << 10


class MediaStage:
    """The gateway's side of the encoder: encode a request's media, release refs it never forwarded."""

    def __init__(
        self,
        encoder: EncoderClient,
        transport: TransportContext,
        *,
        max_request_bytes: int,
        allow_cuda_ipc: bool = False,
    ) -> None:
        self.encoder = encoder
        self.transport = transport
        # The encoder's max_message_bytes: one Encode request carries every part's bytes.
        self.max_media_bytes = max_request_bytes - MESSAGE_OVERHEAD
        # The thinker runs on a GPU: embeddings made on the encoder's GPU may stay there (CUDA IPC).
        self.allow_cuda_ipc = allow_cuda_ipc

    async def encode(
        self, request_id: str, parts: Sequence[MediaPart], paths: dict[str, Path], timeout_s: float | None
    ) -> list[encoder_pb2.EncodedItem]:
        """One encoder output per part, in order. Encoder refusals name the part (`messages[0].parts[1].image`)."""
        items = [await self._item(part, paths) for part in parts]
        size = sum(len(item.data) for item in items)
        if size > self.max_media_bytes:
            raise InvalidRequest(
                f"messages: the media parts hold {size} bytes, more than the {self.max_media_bytes} one encoder "
                "request takes"
            )
        request = encoder_pb2.EncodeRequest(
            request_id=request_id, items=items, allow_cuda_ipc=self.allow_cuda_ipc
        )
        try:
            response = await self.encoder.encode(request, timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise StageError("encoder", exc, _name_parts(exc.details() or "", parts)) from exc
        if len(response.items) != len(parts):
            self.release(response.items)
            raise RuntimeError(f"encoder returned {len(response.items)} items for {len(parts)} media parts")
        return list(response.items)

    async def _item(self, part: MediaPart, paths: dict[str, Path]) -> encoder_pb2.EncodeItem:
        if part.media.WhichOneof("source") == "data":
            return encoder_pb2.EncodeItem(kind=_KIND[part.kind], data=part.media.data)
        where = f"{part.where}.path"
        data = await asyncio.to_thread(_read, paths[where], where, self.max_media_bytes)
        return encoder_pb2.EncodeItem(kind=_KIND[part.kind], data=data)

    def release(self, items: Sequence[encoder_pb2.EncodedItem]) -> None:
        """End the leases of refs that will not reach the thinker (a second release is a no-op)."""
        for item in items:
            release_quietly(self.transport, item.embeddings, "embedding lease")  # the encoder may be gone

    async def close(self) -> None:
        await self.encoder.close()
        self.transport.close()


def thinker_items(items: Sequence[encoder_pb2.EncodedItem]) -> list[thinker_pb2.MultimodalEmbedding]:
    """The thinker's view of the encoder's outputs: the same refs, placeholder ids and grids."""
    return [
        thinker_pb2.MultimodalEmbedding(
            placeholder_token_id=it.placeholder_token_id,
            embeddings=it.embeddings,
            merged_grids=it.merged_grids,
        )
        for it in items
    ]


def _read(path: Path, where: str, limit: int) -> bytes:
    """A media file's bytes, refused (naming the part) when it cannot fit one message to the encoder."""
    size = path.stat().st_size
    if size > limit:
        raise InvalidRequest(
            f"{where}: the file has {size} bytes, more than the {limit} one encoder message takes"
        )
    if size == 0:
        raise InvalidRequest(f"{where}: the file is empty")
    return path.read_bytes()


def _name_parts(details: str, parts: Sequence[MediaPart]) -> str:
    """`items[1] (image): reason` → `messages[0].parts[2].image: reason`."""
    match = _ITEM.match(details)
    if match is None or int(match[1]) >= len(parts):
        return details
    return parts[int(match[1])].where + details[match.end() :]
