"""`POST /v1/audio/speech` (the speech as a body or as SSE) and `POST /v1/images/generations`."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from omnistage.services.gateway.openai import answers, omni_params
from omnistage.services.gateway.openai.body import BodyReader, request_id
from omnistage.services.gateway.openai.errors import HttpError
from omnistage.services.gateway.openai.media_requests import SPEECH_FORMATS, image_request, speech_request
from omnistage.services.gateway.openai.omni_calls import OmniCalls
from omnistage.services.gateway.openai.streams import SSE_HEADERS, sse
from omnistage.v1 import omni_pb2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

_log = logging.getLogger(__name__)
Events = AsyncIterator[omni_pb2.GenerateEvent]


async def _first_audio(events: Events) -> omni_pb2.AudioChunk:
    """The answer's first audio: the status waits for it, so an answer with no speech is an error."""
    try:
        async for event in events:
            kind = event.WhichOneof("event")
            if kind == "audio" and event.audio.pcm16:
                return event.audio
            if kind == "finish":
                raise answers.finish_error(event.finish) or answers.speech_error(event.finish.audio)
        raise HttpError(
            502, "the gateway's stream ended without audio or a finish event", type="server_error"
        )
    except BaseException:
        await events.aclose()
        raise


async def speech_bytes(first: omni_pb2.AudioChunk, events: Events, fmt: str) -> AsyncIterator[bytes]:
    """The speech as one body (`wav`: behind a streaming header)."""
    yield (answers.streaming_wav_header(first.sample_rate_hz) if fmt == "wav" else b"") + first.pcm16
    try:
        async for event in events:
            if event.WhichOneof("event") == "audio" and event.audio.pcm16:
                yield event.audio.pcm16
    except HttpError as err:  # the status is sent: the body ends short, and the log says why
        _log.warning("speech stream ended early: %s", err.message)
    finally:
        await events.aclose()


def _speech_done(finish: omni_pb2.Finish) -> dict[str, Any]:
    u = answers.usage([finish])
    tokens = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"]}
    return {
        "type": "speech.audio.done",
        "usage": {**tokens, "total_tokens": u["total_tokens"]},
        "audio": answers.audio_status(finish.audio),
    }


async def speech_sse(first: omni_pb2.AudioChunk, events: Events) -> AsyncIterator[bytes]:
    """The speech as `speech.audio.delta` events, then `speech.audio.done`."""
    audio = base64.b64encode(first.pcm16).decode()
    yield sse({"type": "speech.audio.delta", "audio": audio, "sample_rate": first.sample_rate_hz})
    try:
        async for event in events:
            kind = event.WhichOneof("event")
            if kind == "audio" and event.audio.pcm16:
                yield sse(
                    {"type": "speech.audio.delta", "audio": base64.b64encode(event.audio.pcm16).decode()}
                )
            elif kind == "finish":
                yield sse(_speech_done(event.finish))
    except HttpError as err:
        yield sse({"type": "error", **err.body()})
    finally:
        await events.aclose()


class MediaRoutes:
    """The routes over the front's Omni calls; `max_speech_chars` bounds a speech's `input`."""

    def __init__(
        self, calls: OmniCalls, reader: BodyReader, max_speech_chars: int, allow_unknown: bool
    ) -> None:
        self.calls = calls
        self.reader = reader
        self.max_speech_chars = max_speech_chars
        self.allow_unknown = allow_unknown

    def routes(self) -> list[Route]:
        return [
            Route("/v1/audio/speech", self.speech, methods=["POST"]),
            Route("/v1/images/generations", self.images, methods=["POST"]),
        ]

    async def speech(self, request: Request) -> Response:
        rid = request_id(request)
        plan = await self.reader.translate(
            request,
            speech_request,
            request_id=rid,
            max_chars=self.max_speech_chars,
            allow_unknown=self.allow_unknown,
        )
        events = self.calls.events(await self.calls.open(request, plan.request, omni_params.SPEECH))
        first = await _first_audio(events)
        rate = first.sample_rate_hz
        headers = {"x-sample-rate": str(rate), **({"x-request-id": rid} if rid else {})}
        if plan.sse:
            body = speech_sse(first, events)
            return StreamingResponse(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        media = (
            f"audio/pcm;rate={rate}"
            if plan.response_format == "pcm"
            else SPEECH_FORMATS[plan.response_format]
        )
        return StreamingResponse(
            speech_bytes(first, events, plan.response_format), media_type=media, headers=headers
        )

    async def images(self, request: Request) -> Response:
        rid = request_id(request)
        omni = await self.reader.translate(
            request, image_request, request_id=rid, allow_unknown=self.allow_unknown
        )
        collected = await self.calls.collect(request, omni, omni_params.IMAGES)
        err = answers.finish_error(collected.finish)
        if err is not None:
            raise err
        if not collected.images:
            raise HttpError(
                500, "the request finished without an image", type="server_error", code="no_image"
            )
        first = collected.images[0]
        prompt_tokens = collected.finish.usage.prompt_tokens
        body = {
            "created": int(time.time()),
            "data": [
                {"b64_json": base64.b64encode(i.png).decode(), "revised_prompt": None}
                for i in collected.images
            ],
            "output_format": "png",
            "size": f"{first.width}x{first.height}",
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0, "total_tokens": prompt_tokens},
        }
        return JSONResponse(body, headers={"x-request-id": rid} if rid else {})
