"""The JSON bodies of `/v1/completions`, `/v1/audio/speech`, `/v1/images/generations`, `/tokenize` and
`/detokenize`, as pydantic models (the chat body: chat_body.py; the rules: schema.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from omnistage.common.sampling import MAX_LOGPROBS
from omnistage.services.gateway.openai.chat_body import (
    MAX_CHOICES,
    MAX_INT32,
    Message,
    SamplingBody,
    Tool,
    ToolChoice,
    Voice,
)
from omnistage.services.gateway.openai.schema import Body, Int, Number, Text, between, one_of, string_or

MAX_SEED = 2**64 - 1


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    return "ids" if value and isinstance(value[0], int) and not isinstance(value[0], bool) else "batch"


# One prompt: a string, token ids, or a list of one of them (OpenAI's batch form, of one prompt here).
# Ids are checked in bulk (a prompt may hold hundreds of thousands): strict integers, 32-bit by the proto.
Prompt = one_of(
    {
        "text": Text,
        "ids": list[int],
        "batch": list[string_or(list[int], "expected a string or an array of token ids")],
    },
    _prompt_kind,
    "expected a string or an array of token ids",
)


class CompletionBody(SamplingBody):
    prompt: Prompt
    best_of: Annotated[Int, between(1, MAX_CHOICES)] | None = None
    echo: bool | None = None
    logprobs: Annotated[Int, between(0, MAX_LOGPROBS)] | None = None
    suffix: Text | None = None


class SpeechBody(Body):
    model: Text = ""
    input: Text
    voice: Voice | None = None
    instructions: Text | None = None
    response_format: Literal["wav", "pcm"] = "wav"
    speed: Annotated[Number, between(0.25, 4.0)] | None = None
    stream_format: Literal["audio", "sse"] = "audio"
    seed: Annotated[Int, between(0, MAX_SEED)] | None = None  # extension
    max_tokens: Annotated[Int, between(1, MAX_INT32)] | None = None  # extension


class ImageBody(Body):
    prompt: Text
    model: Text = ""
    n: Annotated[Int, between(1, 1)] | None = None
    size: Text | None = None
    response_format: Text | None = None
    output_format: Text | None = None
    stream: bool | None = None
    # Documented, ignored.
    quality: Text | None = None
    style: Text | None = None
    output_compression: Int | None = None
    background: Text | None = None
    moderation: Text | None = None
    partial_images: Int | None = None
    user: Text | None = None
    # Extensions.
    num_inference_steps: Annotated[Int, between(1, 10_000)] | None = None
    guidance_scale: Annotated[Number, between(0.0, 1e6)] | None = None
    seed: Annotated[Int, between(0, MAX_SEED)] | None = None


class TokenizeBody(Body):
    """vLLM's `/tokenize`: a raw prompt, or a chat's messages (with its tools)."""

    model: Text = ""
    prompt: Text | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None


class DetokenizeBody(Body):
    model: Text = ""
    tokens: list[int]
