"""Chat answers of `n` choices and their logprobs, in OpenAI's shapes. Pure: no I/O."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from omnistage.services.gateway.openai import translate as tr
from omnistage.v1 import common_pb2, omni_pb2

# A logprob JSON can carry (float32 underflow gives -inf, which JSON has no number for).
MIN_LOGPROB = -9999.0


def choice_requests(plan: tr.ChatPlan) -> list[omni_pb2.GenerateRequest]:
    """The Omni request of each choice: the plan's, choice i seeded with seed + i when it has a seed."""
    out = []
    for i in range(plan.n):
        request = omni_pb2.GenerateRequest()
        request.CopyFrom(plan.request)
        if i and request.sampling.HasField("seed"):
            request.sampling.seed = (request.sampling.seed + i) % 2**64
        out.append(request)
    return out


def clamp_logprob(value: float) -> float:
    """A logprob JSON can carry (at least MIN_LOGPROB)."""
    return value if math.isfinite(value) and value >= MIN_LOGPROB else MIN_LOGPROB


def _token(raw: bytes, logprob: float) -> dict[str, Any]:
    return {
        "token": raw.decode("utf-8", errors="replace"),
        "logprob": clamp_logprob(logprob),
        "bytes": list(raw),
    }


def logprob_content(logprobs: Sequence[common_pb2.TokenLogprobs], top: int) -> list[dict[str, Any]]:
    """`logprobs.content` entries of these tokens, each with its `top` most likely alternatives."""
    return [
        {
            **_token(lp.token, lp.logprob),
            "top_logprobs": [
                _token(raw, value)
                for raw, value in zip(lp.top_tokens[:top], lp.top_logprobs[:top], strict=True)
            ],
        }
        for lp in logprobs
    ]


def logprobs_object(plan: tr.ChatPlan, logprobs: Sequence[common_pb2.TokenLogprobs]) -> dict | None:
    """A choice's `logprobs` (None when the request asked for none)."""
    if not plan.logprobs:
        return None
    return {"content": logprob_content(logprobs, plan.top_logprobs), "refusal": None}


def usage(finishes: Sequence[omni_pb2.Finish]) -> dict[str, Any]:
    """OpenAI's usage of the choices together (see the module docstring)."""
    out = tr.usage(finishes[0] if finishes else None)
    completion = sum(f.usage.completion_tokens for f in finishes)
    out["completion_tokens"] = completion
    out["total_tokens"] = out["prompt_tokens"] + completion
    out["prompt_tokens_details"]["cached_tokens"] = max(
        (f.usage.cached_prompt_tokens for f in finishes), default=0
    )
    return out


def completion(
    results: Sequence[tr.Result], plan: tr.ChatPlan, *, completion_id: str, created: int, model: str
) -> dict[str, Any]:
    """The `chat.completion` of the choices' finished answers."""
    body = tr.chat_completion(
        results[0], completion_id=completion_id, created=created, model=model, audio_format=plan.audio_format
    )
    choices = []
    for i, result in enumerate(results):
        one = (
            body
            if i == 0
            else tr.chat_completion(
                result, completion_id=completion_id, created=created, model=model, audio_format=""
            )
        )
        choice = one["choices"][0]
        choice["index"] = i
        choice["logprobs"] = logprobs_object(plan, result.logprobs)
        choices.append(choice)
    body["choices"] = choices
    body["usage"] = usage([r.finish for r in results if r.finish is not None])
    return body


def chunk(
    completion_id: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    finish: str | None = None,
    logprobs: dict | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk` of choice `index`."""
    out = tr.chunk(completion_id, created, model, delta, finish)
    out["choices"][0]["index"] = index
    out["choices"][0]["logprobs"] = logprobs
    return out
