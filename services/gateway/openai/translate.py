"""Chat and completions bodies → Omni requests. Pure: no I/O, no event loop.

The shapes are checked by the bodies' models (chat_body.py, bodies.py); this module refuses only what
has no Omni equivalent (an http:// image URL, `functions`, ...), naming the JSON field. Everything the
Omni API checks itself (roles, empty parts, limits, voices) is left to it, so the HTTP and gRPC fronts
refuse the same requests with the same words (omni_params.py names the body's field of such a refusal).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

from omnistage.services.gateway.openai import chat_body as cb
from omnistage.services.gateway.openai.bodies import CompletionBody
from omnistage.services.gateway.openai.errors import bad_request
from omnistage.services.gateway.openai.errors import from_grpc as from_grpc  # realtime.py's import
from omnistage.services.gateway.openai.omni_params import CHAT_WORDS, COMPLETION_WORDS, ParamMap
from omnistage.services.gateway.openai.schema import parse, unicode_problem
from omnistage.services.gateway.openai.voices import omni_voice
from omnistage.v1 import common_pb2, omni_pb2

# OpenAI's default temperature (the Omni default, 0, is greedy).
DEFAULT_TEMPERATURE = 1.0
# /v1/completions: OpenAI's default max_tokens.
DEFAULT_COMPLETION_TOKENS = 16


@dataclass
class ChatPlan:
    """A chat (or completions) body translated: the Omni request and how to answer it."""

    request: omni_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    audio_format: str = ""  # "" when no speech was asked for
    model: str = ""
    n: int = 1  # choices: one Omni call each
    logprobs: bool = False
    top_logprobs: int = 0
    forced_tools: tuple[str, ...] = ()  # the names a forced call (required, named) may have
    auto_tools: tuple[str, ...] = ()  # tool_choice auto: the names a call the model opens may have
    params: ParamMap = ParamMap()  # the body's field of an Omni refusal


def _b64(data: str, param: str) -> bytes:
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


def data_url(url: str, param: str) -> omni_pb2.Media:
    """Media of a `data:<mime>;base64,<data>` URL; remote URLs are refused (the gateway fetches nothing)."""
    m = _DATA_URL.match(url)
    if m is None:
        if url.startswith(("http://", "https://")):
            raise bad_request(
                param, "only data: URLs (data:image/png;base64,...) are accepted; the gateway fetches nothing"
            )
        raise bad_request(param, "expected a data URL: data:<mime type>;base64,<data>")
    return omni_pb2.Media(data=_b64(m["data"], param), mime_type=m["mime"] or "")


_AUDIO_MIME = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg"}


def _url(value: str | cb.ImageUrl | cb.MediaUrl) -> str:
    return value if isinstance(value, str) else value.url


def _part(part: Any, where: str) -> omni_pb2.ContentPart:
    if isinstance(part, cb.TextPart):
        return omni_pb2.ContentPart(text=part.text)
    if isinstance(part, cb.ImagePart):
        return omni_pb2.ContentPart(image=data_url(_url(part.image_url), f"{where}.image_url.url"))
    if isinstance(part, cb.AudioPart):
        audio = part.input_audio
        data = _b64(audio.data, f"{where}.input_audio.data")
        return omni_pb2.ContentPart(audio=omni_pb2.Media(data=data, mime_type=_AUDIO_MIME[audio.format]))
    if isinstance(part, cb.AudioUrlPart):
        return omni_pb2.ContentPart(audio=data_url(_url(part.audio_url), f"{where}.audio_url.url"))
    return omni_pb2.ContentPart(video=data_url(_url(part.video_url), f"{where}.video_url.url"))


_ROLES = {
    "system": omni_pb2.ROLE_SYSTEM,
    "developer": omni_pb2.ROLE_SYSTEM,
    "user": omni_pb2.ROLE_USER,
    "assistant": omni_pb2.ROLE_ASSISTANT,
    "tool": omni_pb2.ROLE_TOOL,
}
_FUNCTIONS_API = "the deprecated functions API is not supported: use tools"


def _message(msg: cb.Message, i: int) -> omni_pb2.ChatMessage:
    where = f"messages[{i}]"
    if msg.function_call:
        raise bad_request(f"{where}.function_call", _FUNCTIONS_API)
    calls = [
        omni_pb2.ToolCall(id=c.id, name=c.function.name, arguments_json=c.function.arguments or "{}")
        for c in msg.tool_calls or ()
    ]
    if calls and msg.role != "assistant":
        raise bad_request(f"{where}.tool_calls", "only an assistant message has tool calls")
    content = msg.content
    if content is None and msg.role == "assistant" and msg.audio is not None:
        raise bad_request(
            f"{where}.audio", "earlier audio answers are not kept: send the answer's transcript as content"
        )
    if isinstance(content, str):
        parts = [omni_pb2.ContentPart(text=content)] if content or not calls else []
    elif isinstance(content, list):
        parts = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
    elif calls:
        parts = []
    else:
        raise bad_request(f"{where}.content", "expected a string or a list of content parts")
    return omni_pb2.ChatMessage(
        role=_ROLES[msg.role], parts=parts, tool_calls=calls, tool_call_id=msg.tool_call_id or ""
    )


def _json_text(value: Any, param: str) -> str:
    """A free-form JSON value (a tool's parameters) as the text the model reads; lone surrogates refused."""
    text = json.dumps(value, ensure_ascii=False)
    problem = unicode_problem(text)
    if problem is not None:
        raise bad_request(param, problem)
    return text


def _tool(tool: cb.FunctionTool, i: int) -> omni_pb2.Tool:
    f = tool.function
    params = "" if f.parameters is None else _json_text(f.parameters, f"tools[{i}].function.parameters")
    return omni_pb2.Tool(name=f.name, description=f.description or "", parameters_json=params)


def tools_of(body: cb.ChatBody) -> tuple[list[omni_pb2.Tool], int, str]:
    """(tools, tool_choice, tool_choice_function) of a chat body."""
    if body.functions or body.function_call:
        raise bad_request("functions", _FUNCTIONS_API)
    tools = [_tool(t, i) for i, t in enumerate(body.tools or ())]
    choice = body.tool_choice
    if isinstance(choice, cb.ToolChoiceFunction):
        return tools, omni_pb2.TOOL_CHOICE_FUNCTION, choice.function.name
    kinds = {"none": omni_pb2.TOOL_CHOICE_NONE, "required": omni_pb2.TOOL_CHOICE_REQUIRED}
    return tools, kinds.get(choice or "auto", omni_pb2.TOOL_CHOICE_AUTO), ""


def _forced(tools: list[omni_pb2.Tool], choice: int, function: str) -> tuple[str, ...]:
    """The names a forced call may have (none when the call is not forced)."""
    if choice == omni_pb2.TOOL_CHOICE_FUNCTION:
        return (function,)
    return tuple(t.name for t in tools) if choice == omni_pb2.TOOL_CHOICE_REQUIRED else ()


def sampling(body: cb.SamplingBody, max_tokens: int | None) -> common_pb2.SamplingParams:
    """SamplingParams of the fields chat and completions share."""
    if body.logit_bias:
        raise bad_request("logit_bias", "not supported")
    if body.frequency_penalty:
        raise bad_request("frequency_penalty", "not supported (presence_penalty and repetition_penalty are)")
    if body.top_p == 0.0:
        raise bad_request("top_p", "must be above 0")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    sp = common_pb2.SamplingParams(
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=body.top_p or 0.0,
        max_tokens=max_tokens or 0,
        presence_penalty=body.presence_penalty or 0.0,
        top_k=max(body.top_k or 0, 0),  # vLLM's -1: off
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 0.0,
        stop=stop,
    )
    if body.seed is not None:
        sp.seed = body.seed % 2**64  # OpenAI seeds are signed 64-bit; Omni's are unsigned
    if body.ignore_eos is not None:
        sp.ignore_eos = body.ignore_eos
    if body.skip_special_tokens is False:  # vLLM's default (true) is the thinker's
        sp.keep_special_tokens = True
    return sp


def _chat_sampling(body: cb.ChatBody) -> common_pb2.SamplingParams:
    if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
        raise bad_request(
            "max_completion_tokens",
            f"differs from max_tokens ({body.max_completion_tokens} vs {body.max_tokens}); give one",
        )
    sp = sampling(body, body.max_completion_tokens or body.max_tokens)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs", "needs logprobs: true")
    if body.logprobs:  # the chosen token's logprob comes with the top list: at least one of it
        sp.logprobs = max(body.top_logprobs or 0, 1)
    for key in ("prediction", "web_search_options"):
        if getattr(body, key):
            raise bad_request(key, "not supported")
    constraint = response_format(body.response_format)
    if constraint is not None:
        sp.constraint.CopyFrom(constraint)
    return sp


def response_format(value: Any) -> common_pb2.GrammarConstraint | None:
    """The thinker's constraint of a chat `response_format` (structured outputs); None for text."""
    if isinstance(value, cb.JsonObjectFormat):
        return common_pb2.GrammarConstraint(json_object=True)
    if not isinstance(value, cb.JsonSchemaFormat):
        return None
    schema = value.json_schema.schema_
    if schema is None:
        raise bad_request("response_format.json_schema.schema", "the JSON Schema is required")
    return common_pb2.GrammarConstraint(json_schema=json.dumps(schema, separators=(",", ":")))


def _voice(value: str | cb.VoiceId | None) -> str:
    return omni_voice(value.id if isinstance(value, cb.VoiceId) else value or "")


def _params(body: cb.ChatBody) -> ParamMap:
    words = CHAT_WORDS | {
        "max_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    }
    strings = frozenset(i for i, m in enumerate(body.messages) if isinstance(m.content, str))
    return ParamMap(words, strings)


def chat_plan(body: cb.ChatBody, request_id: str = "") -> ChatPlan:
    """The Omni request of a checked /v1/chat/completions body (HttpError 400 naming the field)."""
    tools, tool_choice, tool_function = tools_of(body)
    outputs, audio = [omni_pb2.MODALITY_TEXT], None
    if "audio" in (body.modalities or ()):
        outputs.append(omni_pb2.MODALITY_AUDIO)
        audio = body.audio or cb.AudioOutput()
    n = body.n or 1
    if n > 1 and audio is not None:
        raise bad_request("n", "more than one choice with a spoken answer is not supported")
    request = omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=[_message(m, i) for i, m in enumerate(body.messages)],
        output_modalities=outputs,
        sampling=_chat_sampling(body),
        voice=_voice(audio.voice) if audio is not None else "",
        tools=tools,
        tool_choice=tool_choice,
        tool_choice_function=tool_function,
    )
    options = body.stream_options or cb.StreamOptions()
    return ChatPlan(
        request,
        bool(body.stream),
        bool(options.include_usage),
        audio.format if audio is not None else "",
        body.model,
        n,
        bool(body.logprobs),
        body.top_logprobs or 0,
        _forced(tools, tool_choice, tool_function),
        tuple(t.name for t in tools) if tool_choice == omni_pb2.TOOL_CHOICE_AUTO else (),
        _params(body),
    )


def chat_request(data: Any, *, request_id: str = "", allow_unknown: bool = False) -> ChatPlan:
    """The plan of a /v1/chat/completions JSON body (HttpError 400 naming the field)."""
    return chat_plan(parse(cb.ChatBody, data, allow_unknown=allow_unknown), request_id)


def _prompt(value: Any) -> str | list[int]:
    """One prompt: a string, or a token array (ids; the thinker refuses special tokens in it)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list | str):
        value = value[0]
    if isinstance(value, list) and value and isinstance(value[0], int):
        return value
    if isinstance(value, list) and value:
        raise bad_request("prompt", f"one prompt per request, got a list of {len(value)}")
    if not value:
        raise bad_request("prompt", "expected a non-empty string or an array of token ids")
    return value


def completion_request(data: Any, *, request_id: str = "", allow_unknown: bool = False) -> ChatPlan:
    """The plan of a /v1/completions JSON body (HttpError 400 naming the field)."""
    body = parse(CompletionBody, data, allow_unknown=allow_unknown)
    prompt = _prompt(body.prompt)
    if body.echo:
        raise bad_request("echo", "not supported (the answer never repeats the prompt)")
    if body.suffix:
        raise bad_request("suffix", "not supported (no fill-in-the-middle)")
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise bad_request("best_of", f"only equal to n ({n}): no server-side ranking")
    sp = sampling(body, body.max_tokens or DEFAULT_COMPLETION_TOKENS)
    if body.logprobs is not None:
        sp.logprobs = max(body.logprobs, 1)
    request = omni_pb2.GenerateRequest(
        request_id=request_id, output_modalities=[omni_pb2.MODALITY_TEXT], sampling=sp
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        try:
            request.prompt_token_ids.extend(prompt)
        except ValueError:
            raise bad_request("prompt", "token ids must be 32-bit integers") from None
    options = body.stream_options or cb.StreamOptions()
    return ChatPlan(
        request,
        bool(body.stream),
        bool(options.include_usage),
        model=body.model,
        n=n,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        params=ParamMap(COMPLETION_WORDS),
    )


def choice_requests(plan: ChatPlan) -> list[omni_pb2.GenerateRequest]:
    """The Omni request of each choice: the plan's, choice i seeded with seed + i when it has a seed (a
    copy: a prompt of 450,000 token ids takes ~20 ms to copy)."""
    out = [plan.request]
    for i in range(1, plan.n):
        request = omni_pb2.GenerateRequest()
        request.CopyFrom(plan.request)
        if request.sampling.HasField("seed"):
            request.sampling.seed = (request.sampling.seed + i) % 2**64
        out.append(request)
    return out
