"""A request's media parts → one Encoder.Encode call → what the prompt and the thinker need."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.transport import TransportContext
from omnistage.common.transport.release import release_quietly
from omnistage.services.gateway.stages import EncoderClient, StageError
from omnistage.services.gateway.validation import MediaPart, PlannedRequest
from omnistage.v1 import encoder_pb2, tensor_pb2, thinker_pb2

_KIND = {
    "image": encoder_pb2.MEDIA_KIND_IMAGE,
    "audio": encoder_pb2.MEDIA_KIND_AUDIO,
    "video": encoder_pb2.MEDIA_KIND_VIDEO,
}
_ITEM = re.compile(r"^items\[(\d+)\](?: \((?:image|audio|video)\))?")
# Room kept in an Encode message for everything but the media bytes.
MESSAGE_OVERHEAD = 64 << 10
# Leases this close to their expiry are not sent to a thinker call: they are encoded again.
_LEASE_MARGIN_MS = 1000


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
        size = sum(len(item.data) + len(item.samples.inline_data) for item in items)
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
        if part.pcm_rate_hz:  # PCM16 as it came: the encoder's samples (int16), no WAV to decode
            pcm = part.media.data
            samples = tensor_pb2.TensorRef(
                dtype=tensor_pb2.DTYPE_INT16, shape=[len(pcm) // 2], inline_data=pcm
            )
            return encoder_pb2.EncodeItem(
                kind=_KIND[part.kind], samples=samples, sample_rate_hz=part.pcm_rate_hz
            )
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


class EncodedMedia:
    """A request's media, encoded at the first thinker call that needs them, and their leases: kept by
    the gateway for all but the last call, handed to the thinker by that one's `started`, released
    here for whatever no thinker took (`release`, when the request ends)."""

    def __init__(
        self,
        stage: MediaStage | None,
        request: PlannedRequest,
        paths: dict[str, Path],
        slot: Any,
        calls: int = 1,
    ) -> None:
        self.stage = stage
        self.request = request
        self.paths = paths
        # (remaining_s) → the async context of a slot of the encoder's gate (Ticket.slot), or None:
        # not gated (a Converse call is admitted once, at the thinker's gate).
        self.slot = slot
        self.calls_left = calls
        self.items: list[encoder_pb2.EncodedItem] = []
        self.held = False  # the gateway holds the items' leases
        self.encodes = 0

    async def for_call(self, remaining_s: float | None) -> list[encoder_pb2.EncodedItem]:
        """The encoder's outputs for the next thinker call: encoded the first time (and again when their
        leases would run out before that call takes them)."""
        self.calls_left -= 1
        if not self.request.media:
            return []
        if self.items and expiring(self.items):
            self.release()
            self.items = []
        if not self.items:
            async with self.slot(remaining_s) if self.slot is not None else contextlib.nullcontext():
                self.items = await self.stage.encode(
                    self.request.request_id, self.request.media, self.paths, remaining_s
                )
            self.held, self.encodes = True, self.encodes + 1
        return self.items

    def thinker_items(self) -> list[thinker_pb2.MultimodalEmbedding]:
        """The thinker's view of the items; a call that is not the last one leaves the leases here."""
        items = thinker_items(self.items)
        for item in items:
            item.caller_keeps_lease = self.calls_left > 0
        return items

    def taken(self) -> None:
        """The thinker took the call (`started`): after the last call, the leases are its business."""
        if self.calls_left <= 0:
            self.held = False

    def release(self) -> None:
        if self.held and self.items:
            self.stage.release(self.items)
        self.held = False


def expiring(items: Sequence[encoder_pb2.EncodedItem], margin_ms: int = _LEASE_MARGIN_MS) -> bool:
    """Some item's lease ends within `margin_ms` (inline items have none)."""
    soon = time.time() * 1000 + margin_ms
    for item in items:
        ref = item.embeddings
        kind = ref.WhichOneof("payload")
        sub = ref.shm if kind == "shm" else ref.cuda if kind == "cuda" else None
        if sub is not None and sub.lease_expiry_unix_ms and sub.lease_expiry_unix_ms < soon:
            return True
    return False


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
