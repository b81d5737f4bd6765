"""OpenAI request bodies ⇄ Omni protos, and gRPC status ⇄ HTTP errors. Pure: no I/O, no event loop.

Everything the Omni API checks itself (roles, empty parts, limits, voices, sampling ranges) is left to
it, so the HTTP and gRPC fronts refuse the same requests with the same words; this module refuses
only what has no Omni equivalent (an http:// image URL, tools, ...), naming the JSON field.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from omnistage.common.client import Result, wav_bytes
from omnistage.common.runtime.errors import RETRY_PUSHBACK_KEY
from omnistage.common.sampling import MAX_LOGPROBS
from omnistage.v1 import common_pb2, omni_pb2

# OpenAI's default temperature (the Omni default, 0, is greedy).
DEFAULT_TEMPERATURE = 1.0
# Most choices (`n`) of one chat request: each is its own Omni call, admitted as any other.
MAX_CHOICES = 16
# /v1/audio/speech: the thinker is asked to say the input back; it has no plain text-to-speech call.
SPEECH_SYSTEM_PROMPT = "Repeat the user's message word for word, exactly as written, and nothing else."


class HttpError(Exception):
    """An OpenAI-style error response: status, message, type, code, param and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str, message: str) -> HttpError:
    return HttpError(400, f"{param}: {message}", param=param, code="invalid_value")


# gRPC status → (HTTP status, OpenAI error type).
_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def pushback_ms(trailing: Iterable[tuple[str, Any]] | None) -> int | None:
    """The gateway's `grpc-retry-pushback-ms` trailer, or None."""
    for key, value in trailing or ():
        if key.lower() == RETRY_PUSHBACK_KEY:
            try:
                return max(0, int(value.decode() if isinstance(value, bytes) else value))
            except ValueError:
                return None
    return None


def retry_headers(ms: int) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1) and retry-after-ms (which the openai client prefers)."""
    return {"Retry-After": str(max(1, math.ceil(ms / 1000))), "retry-after-ms": str(ms)}


def from_grpc(
    code: grpc.StatusCode, details: str | None, trailing: Iterable[tuple[str, Any]] | None = ()
) -> HttpError:
    """The HTTP error of a failed Omni call."""
    details = details or code.name
    status, kind = _STATUS.get(code, (500, "server_error"))
    headers: dict[str, str] = {}
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "larger than max" in details:  # gRPC's own message-size limit: the body, not the load
            return HttpError(413, details, code="request_too_large")
        ms = pushback_ms(trailing)
        headers = retry_headers(ms if ms is not None else 1000)
    return HttpError(status, details, type=kind, code=code.name.lower(), headers=headers)


# ---------------------------------------------------------------------------------------------------
# Request bodies


def _expect(value: Any, types: type | tuple[type, ...], param: str, what: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad_request(param, f"expected {what}, got a boolean")
    if not isinstance(value, types):
        raise bad_request(param, f"expected {what}, got {type(value).__name__}")
    return value


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    _expect(value, (int, float), key, "a number")
    if not (math.isfinite(value) and lo <= value <= hi):
        raise bad_request(key, f"must be in [{lo:g}, {hi:g}], got {value}")
    return float(value)


def _integer(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    """An integer field; an integral float (`8.0`, as JavaScript clients send numbers) is taken as one."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    _expect(value, int, key, "an integer")
    if not lo <= value <= hi:
        raise bad_request(key, f"must be in [{lo}, {hi}], got {value}")
    return value


def _boolean(value: Any, param: str) -> bool:
    """A JSON boolean (null or absent: false); `"yes"`, `1` and `"false"` are refused, never guessed."""
    return False if value is None else _expect(value, bool, param, "a boolean (true or false)")


def _b64(data: Any, param: str) -> bytes:
    _expect(data, str, param, "a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(param, "not valid base64") from None
    if not raw:
        raise bad_request(param, "empty")
    return raw


_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.S
)


def data_url(url: Any, param: str) -> omni_pb2.Media:
    """Media of a `data:<mime>;base64,<data>` URL; remote URLs are refused (the gateway fetches nothing)."""
    _expect(url, str, param, "a data: URL")
    m = _DATA_URL.match(url)
    if m is None:
        if url.startswith(("http://", "https://")):
            raise bad_request(
                param, "only data: URLs (data:image/png;base64,...) are accepted; the gateway fetches nothing"
            )
        raise bad_request(param, "expected a data URL: data:<mime type>;base64,<data>")
    return omni_pb2.Media(data=_b64(m["data"], param), mime_type=m["mime"] or "")


_AUDIO_MIME = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg"}


def _part(part: Any, where: str) -> omni_pb2.ContentPart:
    _expect(part, dict, where, "a content part object")
    kind = part.get("type")
    if kind == "text":
        return omni_pb2.ContentPart(text=_expect(part.get("text"), str, f"{where}.text", "a string"))
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        return omni_pb2.ContentPart(image=data_url(url, f"{where}.image_url.url"))
    if kind == "input_audio":
        audio = _expect(part.get("input_audio"), dict, f"{where}.input_audio", "an object")
        fmt = audio.get("format", "wav")
        if fmt not in _AUDIO_MIME:
            raise bad_request(f"{where}.input_audio.format", f"one of {', '.join(_AUDIO_MIME)}, got {fmt!r}")
        return omni_pb2.ContentPart(
            audio=omni_pb2.Media(
                data=_b64(audio.get("data"), f"{where}.input_audio.data"), mime_type=_AUDIO_MIME[fmt]
            )
        )
    if kind in ("audio_url", "video_url"):  # de-facto extensions (vLLM): data URLs only
        inner = part.get(kind)
        url = inner.get("url") if isinstance(inner, dict) else inner
        media = data_url(url, f"{where}.{kind}.url")
        return omni_pb2.ContentPart(audio=media) if kind == "audio_url" else omni_pb2.ContentPart(video=media)
    raise bad_request(
        f"{where}.type", f"one of text, image_url, input_audio, audio_url, video_url, got {kind!r}"
    )


_ROLES = {
    "system": omni_pb2.ROLE_SYSTEM,
    "developer": omni_pb2.ROLE_SYSTEM,
    "user": omni_pb2.ROLE_USER,
    "assistant": omni_pb2.ROLE_ASSISTANT,
    "tool": omni_pb2.ROLE_TOOL,
}


def _tool_calls(calls: Any, where: str) -> list[omni_pb2.ToolCall]:
    """An assistant message's earlier `tool_calls` (function calls; arguments as JSON text)."""
    _expect(calls, list, where, "a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        _expect(call, dict, at, "a tool call object")
        function = _expect(call.get("function"), dict, f"{at}.function", "an object {name, arguments}")
        name = _expect(function.get("name"), str, f"{at}.function.name", "a string")
        arguments = function.get("arguments") or "{}"
        _expect(arguments, str, f"{at}.function.arguments", "a JSON string")
        call_id = _expect(call.get("id") or "", str, f"{at}.id", "a string")
        out.append(omni_pb2.ToolCall(id=call_id, name=name, arguments_json=arguments))
    return out


def tools_of(body: Mapping[str, Any]) -> tuple[list[omni_pb2.Tool], int, str]:
    """(tools, tool_choice, tool_choice_function) of a chat body."""
    if body.get("functions") or body.get("function_call"):
        raise bad_request("functions", "the deprecated functions API is not supported: use tools")
    tools = []
    for i, tool in enumerate(_expect(body.get("tools") or [], list, "tools", "a list of tools")):
        where = f"tools[{i}]"
        _expect(tool, dict, where, "a tool object")
        if tool.get("type", "function") != "function":
            raise bad_request(f"{where}.type", f'only "function" tools, got {tool.get("type")!r}')
        function = _expect(tool.get("function"), dict, f"{where}.function", "an object {name, parameters}")
        params = function.get("parameters")
        tools.append(
            omni_pb2.Tool(
                name=_expect(function.get("name"), str, f"{where}.function.name", "a string"),
                description=_expect(
                    function.get("description") or "", str, f"{where}.function.description", "a string"
                ),
                parameters_json=json.dumps(
                    _expect(params, dict, f"{where}.function.parameters", "a JSON Schema object"),
                    ensure_ascii=False,
                )
                if params is not None
                else "",
            )
        )
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return tools, omni_pb2.TOOL_CHOICE_AUTO, ""
    if choice == "none":
        return tools, omni_pb2.TOOL_CHOICE_NONE, ""
    if choice == "required":
        return tools, omni_pb2.TOOL_CHOICE_REQUIRED, ""
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(
            "tool_choice",
            'one of "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        )
    return tools, omni_pb2.TOOL_CHOICE_FUNCTION, function["name"]


def _message(msg: Any, i: int) -> omni_pb2.ChatMessage:
    where = f"messages[{i}]"
    _expect(msg, dict, where, "a message object")
    role = msg.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role", f"one of system, developer, user, assistant, tool; got {role!r}")
    if msg.get("function_call"):
        raise bad_request(
            f"{where}.function_call", "the deprecated functions API is not supported: use tools"
        )
    calls = _tool_calls(msg["tool_calls"], f"{where}.tool_calls") if msg.get("tool_calls") else []
    if calls and role != "assistant":
        raise bad_request(f"{where}.tool_calls", "only an assistant message has tool calls")
    content = msg.get("content")
    if content is None and role == "assistant" and isinstance(msg.get("audio"), dict):
        raise bad_request(
            f"{where}.audio", "earlier audio answers are not kept: send the answer's transcript as content"
        )
    if isinstance(content, str):
        parts = [omni_pb2.ContentPart(text=content)] if content or not calls else []
    elif isinstance(content, list):
        parts = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
    elif content is None and calls:
        parts = []
    else:
        raise bad_request(f"{where}.content", "expected a string or a list of content parts")
    call_id = _expect(msg.get("tool_call_id") or "", str, f"{where}.tool_call_id", "a string")
    return omni_pb2.ChatMessage(role=_ROLES[role], parts=parts, tool_calls=calls, tool_call_id=call_id)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise bad_request("stop", "expected a string or a list of strings")


def sampling(
    body: Mapping[str, Any], *, default_temperature: float = DEFAULT_TEMPERATURE
) -> common_pb2.SamplingParams:
    """SamplingParams of a chat body (OpenAI fields, plus vLLM's top_k / min_p / repetition_penalty / ignore_eos)."""
    max_tokens = _integer(body, "max_tokens", 1, 2**31 - 1)
    max_completion = _integer(body, "max_completion_tokens", 1, 2**31 - 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad_request(
            "max_completion_tokens", f"differs from max_tokens ({max_completion} vs {max_tokens}); give one"
        )
    temperature = _number(body, "temperature", 0.0, 2.0)
    sp = common_pb2.SamplingParams(
        temperature=default_temperature if temperature is None else temperature,
        top_p=_number(body, "top_p", 0.0, 1.0) or 0.0,
        max_tokens=max_completion or max_tokens or 0,
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        top_k=_integer(body, "top_k", -1, 2**31 - 1) or 0,
        min_p=_number(body, "min_p", 0.0, 1.0) or 0.0,
        repetition_penalty=_number(body, "repetition_penalty", 0.01, 100.0) or 0.0,
        stop=_stop(body.get("stop")),
    )
    if sp.top_k < 0:
        sp.top_k = 0  # vLLM's -1: off
    if body.get("top_p") is not None and sp.top_p == 0.0:
        raise bad_request("top_p", "must be above 0")
    seed = _integer(body, "seed", -(2**63), 2**64 - 1)
    if seed is not None:
        sp.seed = seed % 2**64  # OpenAI seeds are signed 64-bit; Omni's are unsigned
    if body.get("ignore_eos") is not None:
        sp.ignore_eos = bool(_expect(body["ignore_eos"], bool, "ignore_eos", "a boolean"))
    if _number(body, "frequency_penalty", -2.0, 2.0):
        raise bad_request("frequency_penalty", "not supported (presence_penalty and repetition_penalty are)")
    logprobs = _boolean(body.get("logprobs"), "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise bad_request("top_logprobs", "needs logprobs: true")
    if logprobs:  # the chosen token's logprob comes with the top list: at least one of it
        sp.logprobs = max(top or 0, 1)
    if body.get("logit_bias"):
        raise bad_request("logit_bias", "not supported")
    for key in ("prediction", "web_search_options"):
        if body.get(key):
            raise bad_request(key, "not supported")
    return sp


def response_format(value: Any) -> common_pb2.GrammarConstraint | None:
    """The thinker's constraint of a chat `response_format` (structured outputs); None for text."""
    if value is None:
        return None
    _expect(value, dict, "response_format", 'an object {"type": ...}')
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.GrammarConstraint(json_object=True)
    if kind != "json_schema":
        raise bad_request("response_format.type", f"one of text, json_object, json_schema; got {kind!r}")
    spec = _expect(value.get("json_schema"), dict, "response_format.json_schema", "an object {name, schema}")
    schema = spec.get("schema")
    if schema is None:
        raise bad_request("response_format.json_schema.schema", "the JSON Schema is required")
    _expect(schema, (dict, bool), "response_format.json_schema.schema", "a JSON Schema object")
    return common_pb2.GrammarConstraint(json_schema=json.dumps(schema, separators=(",", ":")))


AUDIO_FORMATS = ("wav", "pcm16")


@dataclass
class ChatPlan:
    """A chat body translated: the Omni request and how to answer it."""

    request: omni_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    audio_format: str = ""  # "" when no speech was asked for
    model: str = ""
    n: int = 1  # choices: one Omni call each
    logprobs: bool = False
    top_logprobs: int = 0


def chat_request(body: Any, *, request_id: str = "") -> ChatPlan:
    """The Omni request of a /v1/chat/completions body (HttpError 400 naming the field)."""
    _expect(body, dict, "body", "a JSON object")
    model = _expect(body.get("model", ""), str, "model", "a string")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "expected a non-empty list of messages")
    n = _integer(body, "n", 1, MAX_CHOICES) or 1
    tools, tool_choice, tool_function = tools_of(body)
    modalities = body.get("modalities") or ["text"]
    if not isinstance(modalities, list) or not all(m in ("text", "audio") for m in modalities):
        raise bad_request("modalities", 'a list of "text" and "audio" (images: /v1/images/generations)')
    outputs = [omni_pb2.MODALITY_TEXT]
    audio_format = ""
    voice = ""
    if "audio" in modalities:
        outputs.append(omni_pb2.MODALITY_AUDIO)
        audio = body.get("audio") or {}
        _expect(audio, dict, "audio", "an object {voice, format}")
        audio_format = audio.get("format", "wav")
        if audio_format not in AUDIO_FORMATS:
            raise bad_request("audio.format", f"one of {', '.join(AUDIO_FORMATS)}, got {audio_format!r}")
        voice = audio.get("voice") or ""
        if isinstance(voice, dict):
            voice = voice.get("id") or ""
        _expect(voice, str, "audio.voice", "a voice name")
    stream = _boolean(body.get("stream"), "stream")
    options = body.get("stream_options") or {}
    _expect(options, dict, "stream_options", "an object")
    include_usage = _boolean(options.get("include_usage"), "stream_options.include_usage")
    request = omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=[_message(m, i) for i, m in enumerate(messages)],
        output_modalities=outputs,
        sampling=sampling(body),
        voice=voice,
        tools=tools,
        tool_choice=tool_choice,
        tool_choice_function=tool_function,
    )
    constraint = response_format(body.get("response_format"))
    if constraint is not None:
        request.sampling.constraint.CopyFrom(constraint)
    if n > 1 and audio_format:
        raise bad_request("n", "more than one choice with a spoken answer is not supported")
    logprobs = request.sampling.logprobs > 0
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS) or 0
    return ChatPlan(request, stream, include_usage, audio_format, model, n, logprobs, top)


SPEECH_FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm"}


@dataclass
class SpeechPlan:
    request: omni_pb2.GenerateRequest
    response_format: str
    sse: bool


def speech_request(body: Any, *, request_id: str = "", max_chars: int = 4096) -> SpeechPlan:
    """The Omni request of a /v1/audio/speech body: speech only, of the thinker repeating `input`."""
    _expect(body, dict, "body", "a JSON object")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise bad_request("input", "expected the text to speak")
    if len(text) > max_chars:
        raise bad_request("input", f"{len(text)} characters, at most {max_chars}")
    fmt = body.get("response_format", "wav")
    if fmt not in SPEECH_FORMATS:
        raise bad_request("response_format", f"one of {', '.join(SPEECH_FORMATS)}, got {fmt!r}")
    speed = _number(body, "speed", 0.25, 4.0)
    if speed is not None and speed != 1.0:
        raise bad_request("speed", "only 1.0 is supported")
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise bad_request("stream_format", f'"audio" or "sse", got {stream_format!r}')
    voice = body.get("voice") or ""
    if isinstance(voice, dict):
        voice = voice.get("id") or ""
    _expect(voice, str, "voice", "a voice name")
    instructions = _expect(body.get("instructions") or "", str, "instructions", "a string")
    request = omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=text)])],
        output_modalities=[omni_pb2.MODALITY_AUDIO],
        # Greedy, and room for the text said back (a token is ~4 characters), not for a runaway answer.
        sampling=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=_integer(body, "max_tokens", 1, 2**31 - 1) or len(text) // 2 + 16
        ),
        voice=voice,
        system_prompt=SPEECH_SYSTEM_PROMPT + (" " + instructions if instructions else ""),
    )
    seed = _integer(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        request.sampling.seed = seed
    return SpeechPlan(request, fmt, stream_format == "sse")


_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


def image_request(body: Any, *, request_id: str = "") -> omni_pb2.GenerateRequest:
    """The Omni request of a /v1/images/generations body (b64_json PNG, one image)."""
    _expect(body, dict, "body", "a JSON object")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad_request("prompt", "expected a text prompt")
    _integer(body, "n", 1, 1)
    if body.get("response_format", "b64_json") != "b64_json":
        raise bad_request("response_format", "only b64_json (the gateway keeps no files to link to)")
    if body.get("output_format", "png") != "png":
        raise bad_request("output_format", "only png")
    if _boolean(body.get("stream"), "stream"):
        raise bad_request("stream", "streamed partial images are not supported")
    options = omni_pb2.ImageOptions()
    size = body.get("size", "auto")
    if size not in (None, "auto"):
        m = _SIZE.match(size) if isinstance(size, str) else None
        if m is None:
            raise bad_request("size", f'expected "WIDTHxHEIGHT" (e.g. "1024x1024") or "auto", got {size!r}')
        options.width, options.height = int(m[1]), int(m[2])
    steps = _integer(body, "num_inference_steps", 1, 10_000)
    options.steps = steps or 0
    options.guidance_scale = _number(body, "guidance_scale", 0.0, 1e6) or 0.0
    seed = _integer(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        options.seed = seed
    return omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=prompt)])],
        output_modalities=[omni_pb2.MODALITY_IMAGE],
        image=options,
    )


# ---------------------------------------------------------------------------------------------------
# Responses

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    common_pb2.FINISH_REASON_LENGTH: "length",
}


def finish_error(finish: omni_pb2.Finish) -> HttpError | None:
    """The error of a Finish that did not end the answer normally (ERROR, ABORT, INTERRUPTED), else None."""
    if finish.reason in _FINISH:
        return None
    if finish.reason == common_pb2.FINISH_REASON_ERROR:
        return HttpError(500, finish.message or "a stage failed", type="server_error", code="stage_error")
    name = common_pb2.FinishReason.Name(finish.reason).removeprefix("FINISH_REASON_").lower()
    return HttpError(
        503, finish.message or f"the request ended: {name}", type="service_unavailable", code=name
    )


def finish_reason(finish: omni_pb2.Finish) -> str:
    return _FINISH.get(finish.reason, "stop")


def usage(finish: omni_pb2.Finish | None) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` is the thinker's prefix-cache hit."""
    u = finish.usage if finish is not None else common_pb2.Usage()
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


_OUTCOME = {
    omni_pb2.AUDIO_OUTCOME_COMPLETE: "complete",
    omni_pb2.AUDIO_OUTCOME_PARTIAL: "partial",
    omni_pb2.AUDIO_OUTCOME_NONE: "none",
}


def audio_status(status: omni_pb2.AudioStatus) -> dict[str, Any]:
    """Finish.audio as JSON (an extension of the `audio` object)."""
    out: dict[str, Any] = {
        "outcome": _OUTCOME.get(status.outcome, "none"),
        "voice": status.voice,
        "sample_rate": status.sample_rate_hz,
        "samples": status.samples,
    }
    if status.code:
        out["code"], out["message"] = status.code, status.message
    if status.retry_after_ms:
        out["retry_after_ms"] = status.retry_after_ms
    return out


def speech_error(status: omni_pb2.AudioStatus) -> HttpError:
    """The error of an answer that got no audio at all (speech-only endpoints)."""
    code = getattr(grpc.StatusCode, status.code, None) if status.code else None
    message = f"no speech: {status.message or status.code or 'the answer had nothing to speak'}"
    if code is None:
        return HttpError(500, message, type="server_error", code="no_audio")
    err = from_grpc(code, message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        err.headers = retry_headers(status.retry_after_ms or 1000)
    return err


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """A 44-byte PCM16 mono WAV header; `data_bytes` None gives the streaming form (sizes 0xFFFFFFFF)."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


def chat_completion(
    c: Result, *, completion_id: str, created: int, model: str, audio_format: str
) -> dict[str, Any]:
    """The non-streaming chat.completion of a finished stream (gathered by the Python client's `Result`)."""
    assert c.finish is not None
    text = c.text
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if c.tool_calls else "")}
    if c.tool_calls:
        message["tool_calls"] = [tool_call(call) for call in c.tool_calls]
    if audio_format:
        rate = c.sample_rate_hz or c.finish.audio.sample_rate_hz
        data = wav_bytes(c.pcm16, rate) if audio_format == "wav" else c.pcm16
        message["audio"] = {
            "id": f"audio-{completion_id}",
            "data": base64.b64encode(data).decode(),
            "transcript": text,
            "expires_at": created + 3600,
            **audio_status(c.finish.audio),
        }
        message["audio"]["sample_rate"] = rate
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish_reason(c.finish), "logprobs": None}
        ],
        "usage": usage(c.finish),
    }


def tool_call(call: omni_pb2.ToolCall, index: int | None = None) -> dict[str, Any]:
    """An OpenAI tool call object (with `index` in a streamed delta)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out |= {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json},
    }
    return out


def chunk(
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish: str | None = None,
    usage_: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One chat.completion.chunk; `delta` None gives the usage-only chunk (no choices)."""
    out: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    if usage_ is not None:
        out["usage"] = usage_
    return out


class AudioDeltas:
    """delta.audio objects of a streamed answer: base64 data, the first wav one behind a streaming header."""

    def __init__(self, audio_id: str, audio_format: str) -> None:
        self.audio_id = audio_id
        self.format = audio_format
        self.started = False

    def delta(self, chunk_: omni_pb2.AudioChunk) -> dict[str, Any] | None:
        data = chunk_.pcm16
        if self.format == "wav" and not self.started:
            data = wav_header(chunk_.sample_rate_hz) + data
        if not data:
            return None
        first = not self.started
        self.started = True
        out: dict[str, Any] = {"id": self.audio_id, "data": base64.b64encode(data).decode()}
        if first:
            out["sample_rate"] = chunk_.sample_rate_hz
        return out
