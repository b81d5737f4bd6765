"""`POST /v1/audio/transcriptions`: a multipart upload of speech, answered with its text."""

from __future__ import annotations

import asyncio
import io
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from omnistage.services.gateway.openai.answers import finish_error
from omnistage.services.gateway.openai.errors import HttpError, bad_request
from omnistage.services.gateway.openai.schema import unknown_fields
from omnistage.v1 import common_pb2, omni_pb2
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

ASR_INSTRUCTION = "Please recognize the language of this speech and transcribe it. Format: oral."
FIELDS = frozenset(
    {"file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]"}
    | {"stream", "include[]", "chunking_strategy", "max_tokens", "seed"}
)
RESPONSE_FORMATS = ("json", "text", "verbose_json")
MULTIPART = "multipart/form-data"
# Form fields other than the file (their values are small: prompt, model, ...).
MAX_FORM_FIELDS = 32
MAX_FIELD_BYTES = 64 * 1024
_MIME = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "mpeg": "audio/mpeg",
    "mpga": "audio/mpeg",
    "flac": "audio/flac",
    "ogg": "audio/ogg",
    "webm": "audio/webm",
    "m4a": "audio/mp4",
    "mp4": "audio/mp4",
}


@dataclass
class TranscriptionPlan:
    request: omni_pb2.GenerateRequest
    response_format: str
    language: str
    audio: bytes


def _one(form: Any, key: str) -> str | None:
    values = form.getlist(key)
    if len(values) > 1:
        raise bad_request(key, "given more than once")
    if not values:
        return None
    if not isinstance(values[0], str):
        raise bad_request(key, "expected a form field, got a file")
    return values[0]


def _number(form: Any, key: str, lo: float, hi: float) -> float | None:
    raw = _one(form, key)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise bad_request(key, f"expected a number, got {raw[:40]!r}") from None
    if not (math.isfinite(value) and lo <= value <= hi):
        raise bad_request(key, f"must be in [{lo:g}, {hi:g}], got {value:g}")
    return value


def check_form_fields(form: Any, allow_unknown: bool) -> None:
    """OpenAI's refusal of fields its schema does not have (400 naming them), as for JSON bodies."""
    unknown = [key for key in dict.fromkeys(form.keys()) if key not in FIELDS]
    if unknown and not allow_unknown:
        raise unknown_fields(unknown)


def transcription_request(
    form: Any, audio: bytes, filename: str, *, request_id: str = ""
) -> TranscriptionPlan:
    """The Omni request of a transcription form (its file already read into `audio`)."""
    if not audio:
        raise bad_request("file", "empty")
    fmt = _one(form, "response_format") or "json"
    if fmt not in RESPONSE_FORMATS:
        raise bad_request(
            "response_format", f"one of {', '.join(RESPONSE_FORMATS)}, got {fmt!r} (no subtitles)"
        )
    if (_one(form, "stream") or "false").lower() not in ("false", ""):
        raise bad_request("stream", "streamed transcriptions are not supported")
    for key in ("timestamp_granularities[]", "include[]"):
        if form.getlist(key):
            raise bad_request(key, "not supported (no timestamps or logprobs for transcriptions)")
    if _one(form, "chunking_strategy") not in (None, "", "auto"):
        raise bad_request("chunking_strategy", 'only "auto"')
    prompt = _one(form, "prompt") or ""
    language = _one(form, "language") or ""
    text = ASR_INSTRUCTION + (" " + prompt if prompt else "")
    suffix = filename.rsplit(".", 1)[-1].lower() if "." in filename else ""
    sampling = common_pb2.SamplingParams(temperature=_number(form, "temperature", 0.0, 1.0) or 0.0)
    max_tokens = _number(form, "max_tokens", 1, 2**31 - 1)
    if max_tokens is not None:
        sampling.max_tokens = int(max_tokens)
    seed = _number(form, "seed", 0, 2**63 - 1)
    if seed is not None:
        sampling.seed = int(seed)
    request = omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=[
            omni_pb2.ChatMessage(
                role=omni_pb2.ROLE_USER,
                parts=[
                    omni_pb2.ContentPart(text=text),
                    omni_pb2.ContentPart(audio=omni_pb2.Media(data=audio, mime_type=_MIME.get(suffix, ""))),
                ],
            )
        ],
        output_modalities=[omni_pb2.MODALITY_TEXT],
        sampling=sampling,
    )
    return TranscriptionPlan(request, fmt, language, audio)


def duration_s(audio: bytes) -> float:
    """The upload's length in seconds from its container (no decoding); 0.0 when it does not say."""
    import av

    try:
        with av.open(io.BytesIO(audio)) as container:
            if container.duration:
                return container.duration / 1_000_000
            stream = next(iter(container.streams.audio), None)
            if stream is not None and stream.duration and stream.time_base:
                return float(stream.duration * stream.time_base)
    except (av.error.FFmpegError, ValueError, StopIteration):
        pass
    return 0.0


def transcription_body(plan: TranscriptionPlan, text: str, usage: common_pb2.Usage, duration: float) -> dict:
    """The JSON answer (`json` or `verbose_json`)."""
    tokens = {
        "type": "tokens",
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if plan.response_format == "json":
        return {"text": text, "usage": tokens}
    return {
        "task": "transcribe",
        "language": plan.language,
        "duration": duration,
        "text": text,
        "segments": [],
        "usage": {"type": "duration", "seconds": math.ceil(duration)},
    }


class TranscriptionRoute:
    """The route; `collect(request, omni)` runs an Omni call to its end (the front's), `request_id`
    reads the client's x-request-id (the front's rule)."""

    def __init__(
        self,
        collect: Callable[[Request, omni_pb2.GenerateRequest], Awaitable[Any]],
        request_id: Callable[[Request], str],
        allow_unknown: bool,
    ) -> None:
        self.collect = collect
        self.request_id = request_id
        self.allow_unknown = allow_unknown

    def routes(self) -> list[Route]:
        return [Route("/v1/audio/transcriptions", self.transcribe, methods=["POST"])]

    async def transcribe(self, request: Request) -> Response:
        rid = self.request_id(request)
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != MULTIPART:
            raise HttpError(
                400,
                f"content-type: expected {MULTIPART} (a file upload), got {kind or 'none'!r}",
                param="content-type",
                code="invalid_content_type",
            )
        async with request.form(
            max_files=1, max_fields=MAX_FORM_FIELDS, max_part_size=MAX_FIELD_BYTES
        ) as form:
            check_form_fields(form, self.allow_unknown)
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise bad_request("file", "the audio file is required (a multipart file part)")
            audio = await upload.read()
            plan = transcription_request(form, audio, upload.filename or "", request_id=rid)
        collected = await self.collect(request, plan.request)
        err = finish_error(collected.finish)
        if err is not None:
            raise err
        headers = {"x-request-id": rid} if rid else {}
        text = collected.text.strip()
        if plan.response_format == "text":
            return PlainTextResponse(text, headers=headers)
        duration = await asyncio.to_thread(duration_s, plan.audio) if plan.response_format != "json" else 0.0
        return JSONResponse(transcription_body(plan, text, collected.finish.usage, duration), headers=headers)
