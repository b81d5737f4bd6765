"""The top-level fields each route knows, and the refusal of the others (as OpenAI answers them)."""

from __future__ import annotations

from typing import Any

from omnistage.services.gateway.openai.translate import HttpError

# Sampling extensions (vLLM's names) every generating route takes.
SAMPLING_EXTENSIONS = frozenset({"top_k", "min_p", "repetition_penalty", "ignore_eos"})

CHAT = frozenset(
    {
        "messages",
        "model",
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "metadata",
        "modalities",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "prompt_cache_retention",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
    | SAMPLING_EXTENSIONS
)

SPEECH = frozenset(
    {"model", "input", "voice", "instructions", "response_format", "speed", "stream_format"}
    | {"seed", "max_tokens"}
)

IMAGES = frozenset(
    {
        "prompt",
        "model",
        "n",
        "size",
        "quality",
        "style",
        "response_format",
        "output_format",
        "output_compression",
        "background",
        "moderation",
        "stream",
        "partial_images",
        "user",
    }
    | {"num_inference_steps", "guidance_scale", "seed"}
)

# What a route takes: a set of field names, or ANY (gateway.http_allow_unknown_fields).
Known = frozenset[str] | None
ANY: Known = None
# Names listed in one refusal; a body with more unknown fields says how many it left out.
MAX_NAMED = 8


def unknown_fields(body: Any, known: Known) -> list[str]:
    """The body's top-level keys outside `known`, in the body's order ([] for a non-object: the
    translation refuses that itself; [] for ANY)."""
    if known is None or not isinstance(body, dict):
        return []
    return [key for key in body if key not in known]


def check_fields(body: Any, known: Known) -> None:
    """HttpError 400 naming the body's unknown top-level fields."""
    unknown = unknown_fields(body, known)
    if not unknown:
        return
    names = ", ".join(unknown[:MAX_NAMED])
    if len(unknown) > MAX_NAMED:
        names += f" (and {len(unknown) - MAX_NAMED} more)"
    plural = "s" if len(unknown) > 1 else ""
    raise HttpError(
        400,
        f"Unrecognized request argument{plural} supplied: {names}",
        param=unknown[0],
        code="unknown_parameter",
    )
