"""The `/v1/chat/completions` body as OpenAI documents it (and vLLM's extensions), as pydantic models.

Fields OpenAI documents that the front ignores (`user`, `metadata`, `store`, ...) are taken; those it
does not support are typed loosely here and refused by the translation when set (`functions`,
`logit_bias`, `prediction`, ...); anything else is an unknown field (schema.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from omnistage.common.sampling import MAX_LOGPROBS
from omnistage.services.gateway.openai.schema import (
    Body,
    Int,
    Number,
    Text,
    between,
    by_type,
    one_of,
    string_or,
)
from pydantic import Field

# Most choices (`n`) of one request: each is its own Omni call, admitted as any other.
MAX_CHOICES = 16
MAX_INT32 = 2**31 - 1


class StreamOptions(Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's side-channel padding: nothing to pad here


class SamplingBody(Body):
    """The fields chat and completions share: OpenAI's sampling, and vLLM's top_k / min_p /
    repetition_penalty / ignore_eos / skip_special_tokens."""

    model: Text = ""
    max_tokens: Annotated[Int, between(1, MAX_INT32)] | None = None
    temperature: Annotated[Number, between(0, 2)] | None = None
    top_p: Annotated[Number, between(0, 1)] | None = None
    presence_penalty: Annotated[Number, between(-2, 2)] | None = None
    frequency_penalty: Annotated[Number, between(-2, 2)] | None = None
    seed: Annotated[Int, between(-(2**63), 2**64 - 1)] | None = None
    stop: string_or(list[Text], "expected a string or a list of strings") | None = None
    n: Annotated[Int, between(1, MAX_CHOICES)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: Any = None
    user: Text | None = None
    top_k: Annotated[Int, between(-1, MAX_INT32)] | None = None
    min_p: Annotated[Number, between(0, 1)] | None = None
    repetition_penalty: Annotated[Number, between(0.01, 100)] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None


# ---- messages and their content parts


class TextPart(Body):
    type: Literal["text"]
    text: Text


class ImageUrl(Body):
    url: str  # a data URL: checked as ASCII by its base64 decoding, not scanned as text
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Body):
    type: Literal["image_url"]
    image_url: string_or(ImageUrl, "expected a data URL or an object {url}")


class InputAudio(Body):
    data: str
    format: Literal["wav", "mp3", "flac", "ogg"] = "wav"


class AudioPart(Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


class MediaUrl(Body):
    url: str


class AudioUrlPart(Body):  # vLLM's extension
    type: Literal["audio_url"]
    audio_url: string_or(MediaUrl, "expected a data URL or an object {url}")


class VideoUrlPart(Body):  # vLLM's extension
    type: Literal["video_url"]
    video_url: string_or(MediaUrl, "expected a data URL or an object {url}")


Part = by_type(
    {
        "text": TextPart,
        "image_url": ImagePart,
        "input_audio": AudioPart,
        "audio_url": AudioUrlPart,
        "video_url": VideoUrlPart,
    }
)
Content = string_or(list[Part], "expected a string or a list of content parts")


class FunctionCall(Body):
    name: Text
    arguments: Text = "{}"


class ToolCall(Body):
    """An earlier call in an assistant message."""

    id: Text = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class AudioReference(Body):
    id: Text


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    refusal: Text | None = None
    audio: AudioReference | None = None
    function_call: Any = None


# ---- tools, answers' formats, audio out


class FunctionDef(Body):
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


Tool = by_type({"function": FunctionTool}, default="function")


class NamedFunction(Body):
    name: Text


class ToolChoiceFunction(Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = one_of(
    {"string": Literal["none", "auto", "required"], "object": by_type({"function": ToolChoiceFunction})},
    lambda v: "string" if isinstance(v, str) else "object" if isinstance(v, dict) else None,
    'one of "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
)


class JsonSchemaSpec(Body):
    name: Text
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = by_type(
    {"text": TextFormat, "json_object": JsonObjectFormat, "json_schema": JsonSchemaFormat}
)


class VoiceId(Body):
    id: Text


Voice = string_or(VoiceId, "expected a voice name or an object {id}")


class AudioOutput(Body):
    voice: Voice | None = None
    format: Literal["wav", "pcm16"] = "wav"


class ChatBody(SamplingBody):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, between(1, MAX_INT32)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[Int, between(0, MAX_LOGPROBS)] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOutput | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Documented, ignored.
    metadata: dict[str, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    reasoning_effort: Text | None = None
    verbosity: Text | None = None
    # Documented, refused when set (the translation names them).
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    web_search_options: Any = None
