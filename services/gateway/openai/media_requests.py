"""`/v1/audio/speech` and `/v1/images/generations` bodies → Omni requests. Pure: no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from omnistage.services.gateway.openai.bodies import ImageBody, SpeechBody
from omnistage.services.gateway.openai.chat_body import VoiceId
from omnistage.services.gateway.openai.errors import bad_request
from omnistage.services.gateway.openai.schema import parse
from omnistage.services.gateway.openai.voices import omni_voice
from omnistage.v1 import common_pb2, omni_pb2

# /v1/audio/speech: the thinker is asked to say the input back; it has no plain text-to-speech call.
SPEECH_SYSTEM_PROMPT = "Repeat the user's message word for word, exactly as written, and nothing else."
SPEECH_FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm"}


@dataclass
class SpeechPlan:
    request: omni_pb2.GenerateRequest
    response_format: str
    sse: bool


def _user(text: str) -> list[omni_pb2.ChatMessage]:
    return [omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=text)])]


def speech_request(
    data: Any, *, request_id: str = "", max_chars: int = 4096, allow_unknown: bool = False
) -> SpeechPlan:
    """The Omni request of a /v1/audio/speech body: speech only, of the thinker repeating `input`."""
    body = parse(SpeechBody, data, allow_unknown=allow_unknown)
    text = body.input
    if not text.strip():
        raise bad_request("input", "expected the text to speak")
    if len(text) > max_chars:
        raise bad_request("input", f"{len(text)} characters, at most {max_chars}")
    if body.speed is not None and body.speed != 1.0:
        raise bad_request("speed", "only 1.0 is supported")
    voice = body.voice.id if isinstance(body.voice, VoiceId) else body.voice or ""
    instructions = body.instructions or ""
    request = omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=_user(text),
        output_modalities=[omni_pb2.MODALITY_AUDIO],
        # Greedy, and room for the text said back (a token is ~4 characters), not for a runaway answer.
        sampling=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=body.max_tokens or len(text) // 2 + 16
        ),
        voice=omni_voice(voice),
        system_prompt=SPEECH_SYSTEM_PROMPT + (" " + instructions if instructions else ""),
    )
    if body.seed is not None:
        request.sampling.seed = body.seed
    return SpeechPlan(request, body.response_format, body.stream_format == "sse")


_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


def image_request(
    data: Any, *, request_id: str = "", allow_unknown: bool = False
) -> omni_pb2.GenerateRequest:
    """The Omni request of a /v1/images/generations body (b64_json PNG, one image)."""
    body = parse(ImageBody, data, allow_unknown=allow_unknown)
    if not body.prompt.strip():
        raise bad_request("prompt", "expected a text prompt")
    if body.response_format not in (None, "b64_json"):
        raise bad_request("response_format", "only b64_json (the gateway keeps no files to link to)")
    if body.output_format not in (None, "png"):
        raise bad_request("output_format", "only png")
    if body.stream:
        raise bad_request("stream", "streamed partial images are not supported")
    options = omni_pb2.ImageOptions(
        steps=body.num_inference_steps or 0, guidance_scale=body.guidance_scale or 0.0
    )
    if body.size not in (None, "auto"):
        m = _SIZE.match(body.size)
        if m is None:
            raise bad_request(
                "size", f'expected "WIDTHxHEIGHT" (e.g. "1024x1024") or "auto", got {body.size!r}'
            )
        options.width, options.height = int(m[1]), int(m[2])
    if body.seed is not None:
        options.seed = body.seed
    return omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=_user(body.prompt),
        output_modalities=[omni_pb2.MODALITY_IMAGE],
        image=options,
    )
