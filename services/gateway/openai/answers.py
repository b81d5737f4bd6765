"""Finished Omni answers → OpenAI's objects: finish reasons and errors, usage, audio status, tool calls,
logprobs, and the whole `chat.completion` of `n` choices. Pure: no I/O."""

from __future__ import annotations

import base64
import math
import re
import struct
import uuid
from collections.abc import Sequence
from typing import Any

import grpc
from omnistage.common.client import Result, wav_bytes
from omnistage.services.gateway.openai.errors import HttpError, from_grpc, retry_headers
from omnistage.services.gateway.openai.translate import ChatPlan
from omnistage.services.gateway.tools import CLOSE, OPEN
from omnistage.v1 import common_pb2, omni_pb2

# A logprob JSON can carry (float32 underflow gives -inf, which JSON has no number for).
MIN_LOGPROB = -9999.0

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


def usage(finishes: Sequence[omni_pb2.Finish]) -> dict[str, Any]:
    """OpenAI's usage of one answer or of `n` choices together: the prompt once, every choice's
    completion tokens, and as `cached_tokens` the most any choice took from the thinker's prefix cache."""
    first = finishes[0].usage if finishes else common_pb2.Usage()
    completion = sum(f.usage.completion_tokens for f in finishes)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {
            "cached_tokens": max((f.usage.cached_prompt_tokens for f in finishes), default=0)
        },
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


def streaming_wav_header(sample_rate: int) -> bytes:
    """A PCM16 mono WAV header whose sizes are 0xFFFFFFFF: the start of a stream of unknown length."""
    header = wav_bytes(b"", sample_rate)
    unknown = struct.pack("<I", 0xFFFFFFFF)
    return header[:4] + unknown + header[8:40] + unknown


def tool_call(call: omni_pb2.ToolCall, index: int | None = None) -> dict[str, Any]:
    """An OpenAI tool call object (with `index` in a streamed delta)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out |= {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json},
    }
    return out


_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"')
_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_HEAD = '{"name": "'


def cut_call(text: str, names: Sequence[str]) -> omni_pb2.ToolCall | None:
    """The forced call `max_tokens` cut short (its text `{"name": "get_wea`, as the tool grammar writes
    it), as OpenAI keeps one: the name (completed when one allowed name alone starts so) and the
    arguments as far as they got; None when the text is no call's beginning."""
    head = _CALL_HEAD.match(text)
    if head is None:
        if not _HEAD.startswith(text.strip()):
            return None
        written, arguments = "", ""
    else:
        written, closed, after = text[head.end() :].partition('"')
        rest = _ARGUMENTS.match(after) if closed else None
        arguments = after[rest.end() :] if rest else ""
        if closed:
            names = (written,)
    matches = [n for n in names if n.startswith(written)]
    name = matches[0] if len(matches) == 1 else written
    return omni_pb2.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments_json=arguments)


def opened_call(text: str) -> str | None:
    """What follows a `<tool_call>` that `text` leaves open (the gateway's scanner sends such a block,
    cut by max_tokens, as one last text before the Finish); None when no block is left open."""
    at = text.rfind(OPEN)
    return None if at < 0 or CLOSE in text[at:] else text[at + len(OPEN) :]


def cut_answer(text: str, calls: int, plan: ChatPlan) -> tuple[str, omni_pb2.ToolCall | None]:
    """(text, cut call) of an answer max_tokens ended: a forced call's whole text (when no call was
    read), or an auto answer's open `<tool_call>` block, is a call as OpenAI keeps one (cut_call)."""
    if plan.forced_tools and not calls:
        cut = cut_call(text, plan.forced_tools)
        return ("", cut) if cut is not None else (text, None)
    block = opened_call(text) if plan.auto_tools else None
    cut = cut_call(block, plan.auto_tools) if block is not None else None
    return (text[: len(text) - len(block) - len(OPEN)], cut) if cut is not None else (text, None)


def answer_calls(result: Result, plan: ChatPlan) -> tuple[str, list[omni_pb2.ToolCall]]:
    """(text, tool calls) of a choice: a call cut by max_tokens is a call, not text."""
    calls = list(result.tool_calls)
    if result.finish is None or result.finish.reason != common_pb2.FINISH_REASON_LENGTH:
        return result.text, calls
    text, cut = cut_answer(result.text, len(calls), plan)
    return text, calls + ([cut] if cut is not None else [])


def clamp_logprob(value: float) -> float:
    """A logprob JSON can carry (at least MIN_LOGPROB)."""
    return value if math.isfinite(value) and value >= MIN_LOGPROB else MIN_LOGPROB


def _token(raw: bytes, logprob: float) -> dict[str, Any]:
    return {
        "token": raw.decode("utf-8", errors="replace"),
        "logprob": clamp_logprob(logprob),
        "bytes": list(raw),
    }


def logprobs_object(plan: ChatPlan, logprobs: Sequence[common_pb2.TokenLogprobs]) -> dict | None:
    """A chat choice's `logprobs` (None when the request asked for none): per token, its `top_logprobs`
    most likely alternatives."""
    if not plan.logprobs:
        return None
    top = plan.top_logprobs
    content = [
        {
            **_token(lp.token, lp.logprob),
            "top_logprobs": [
                _token(raw, value)
                for raw, value in zip(lp.top_tokens[:top], lp.top_logprobs[:top], strict=True)
            ],
        }
        for lp in logprobs
    ]
    return {"content": content, "refusal": None}


def _audio(result: Result, plan: ChatPlan, completion_id: str, created: int, text: str) -> dict[str, Any]:
    assert result.finish is not None
    rate = result.sample_rate_hz or result.finish.audio.sample_rate_hz
    data = wav_bytes(result.pcm16, rate) if plan.audio_format == "wav" else result.pcm16
    return {
        "id": f"audio-{completion_id}",
        "data": base64.b64encode(data).decode(),
        "transcript": text,
        "expires_at": created + 3600,
        **audio_status(result.finish.audio),
        "sample_rate": rate,
    }


def _choice(index: int, result: Result, plan: ChatPlan, completion_id: str, created: int) -> dict[str, Any]:
    assert result.finish is not None
    text, calls = answer_calls(result, plan)
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = [tool_call(call) for call in calls]
    if plan.audio_format and index == 0:
        message["audio"] = _audio(result, plan, completion_id, created, text)
    return {
        "index": index,
        "message": message,
        "finish_reason": finish_reason(result.finish),
        "logprobs": logprobs_object(plan, result.logprobs),
    }


def chat_completion(
    results: Sequence[Result], plan: ChatPlan, *, completion_id: str, created: int, model: str
) -> dict[str, Any]:
    """The `chat.completion` of the choices' finished answers."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [_choice(i, r, plan, completion_id, created) for i, r in enumerate(results)],
        "usage": usage([r.finish for r in results if r.finish is not None]),
    }


def legacy_logprobs(logprobs: Sequence[common_pb2.TokenLogprobs], top: int, offset: int) -> dict[str, Any]:
    """/v1/completions' `logprobs` object: tokens, their logprobs, top alternatives as {token: logprob},
    and each token's character offset in the answer (from `offset`)."""
    tokens = [lp.token.decode("utf-8", errors="replace") for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [clamp_logprob(lp.logprob) for lp in logprobs],
        "top_logprobs": [
            {
                raw.decode("utf-8", errors="replace"): clamp_logprob(value)
                for raw, value in zip(lp.top_tokens[:top], lp.top_logprobs[:top], strict=True)
            }
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


def text_completion(
    cid: str, created: int, model: str, choices: list[dict[str, Any]], usage_: dict | None = None
) -> dict[str, Any]:
    """A `text_completion` object (whole, or one streamed chunk)."""
    out: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model}
    out["choices"] = choices
    if usage_ is not None:
        out["usage"] = usage_
    return out


def text_choice(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


def completion_object(
    results: Sequence[Result], plan: ChatPlan, *, completion_id: str, created: int, model: str
) -> dict[str, Any]:
    """The `text_completion` of the choices' finished answers."""
    choices = [
        text_choice(
            i,
            r.text,
            legacy_logprobs(r.logprobs, plan.top_logprobs, 0) if plan.logprobs else None,
            finish_reason(r.finish) if r.finish is not None else None,
        )
        for i, r in enumerate(results)
    ]
    return text_completion(
        completion_id, created, model, choices, usage([r.finish for r in results if r.finish])
    )
