"""`POST /v1/completions` (OpenAI's legacy text completions) on GenerateRequest.prompt or prompt_token_ids."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from omnistage.common.sampling import MAX_LOGPROBS
from omnistage.services.gateway.openai import choices as ch
from omnistage.services.gateway.openai import translate as tr
from omnistage.services.gateway.openai.fan_in import fan_in
from omnistage.services.gateway.openai.fields import SAMPLING_EXTENSIONS, Known
from omnistage.services.gateway.openai.translate import HttpError, bad_request
from omnistage.v1 import common_pb2, omni_pb2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

FIELDS = frozenset(
    {
        "model",
        "prompt",
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
    }
    | SAMPLING_EXTENSIONS
)
DEFAULT_MAX_TOKENS = 16


def _prompt(value: Any) -> str | list[int]:
    """One prompt: a string, or a token array (ids; the thinker refuses special tokens in it)."""
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return value
    if isinstance(value, list):
        if len(value) != 1:
            raise bad_request("prompt", f"one prompt per request, got a list of {len(value)}")
        value = value[0]
        if isinstance(value, list):
            return _prompt(value)
    if not isinstance(value, str) or not value:
        raise bad_request("prompt", "expected a non-empty string or an array of token ids")
    return value


def completion_request(body: Any, *, request_id: str = "") -> tr.ChatPlan:
    """The Omni request of a /v1/completions body (HttpError 400 naming the field)."""
    tr._expect(body, dict, "body", "a JSON object")
    prompt = _prompt(body.get("prompt"))
    if tr._boolean(body.get("echo"), "echo"):
        raise bad_request("echo", "not supported (the answer never repeats the prompt)")
    if body.get("suffix"):
        raise bad_request("suffix", "not supported (no fill-in-the-middle)")
    n = tr._integer(body, "n", 1, tr.MAX_CHOICES) or 1
    best_of = tr._integer(body, "best_of", 1, tr.MAX_CHOICES)
    if best_of is not None and best_of != n:
        raise bad_request("best_of", f"only equal to n ({n}): no server-side ranking")
    top = tr._integer(body, "logprobs", 0, MAX_LOGPROBS)
    sampling = tr.sampling({k: v for k, v in body.items() if k != "logprobs"})
    if not sampling.max_tokens:
        sampling.max_tokens = DEFAULT_MAX_TOKENS
    if top is not None:
        sampling.logprobs = max(top, 1)
    options = tr._expect(body.get("stream_options") or {}, dict, "stream_options", "an object")
    request = omni_pb2.GenerateRequest(
        request_id=request_id, output_modalities=[omni_pb2.MODALITY_TEXT], sampling=sampling
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        try:
            request.prompt_token_ids.extend(prompt)
        except ValueError:
            raise bad_request("prompt", "token ids must be 32-bit integers") from None
    model = tr._expect(body.get("model", ""), str, "model", "a string")
    return tr.ChatPlan(
        request,
        tr._boolean(body.get("stream"), "stream"),
        tr._boolean(options.get("include_usage"), "stream_options.include_usage"),
        model=model,
        n=n,
        logprobs=top is not None,
        top_logprobs=top or 0,
    )


def legacy_logprobs(logprobs: Sequence[common_pb2.TokenLogprobs], top: int, offset: int) -> dict[str, Any]:
    """The legacy `logprobs` object: tokens, their logprobs, top alternatives as {token: logprob}, and
    each token's character offset in the answer (from `offset`)."""
    tokens = [lp.token.decode("utf-8", errors="replace") for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [ch.clamp_logprob(lp.logprob) for lp in logprobs],
        "top_logprobs": [
            {
                raw.decode("utf-8", errors="replace"): ch.clamp_logprob(value)
                for raw, value in zip(lp.top_tokens[:top], lp.top_logprobs[:top], strict=True)
            }
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


class Front(Protocol):
    async def _open_choices(self, request: Request, plan: tr.ChatPlan) -> list: ...
    async def _collect_calls(self, request: Request, opened: list) -> list[tr.Result]: ...
    def _events(self, call, first) -> AsyncIterator[omni_pb2.GenerateEvent]: ...


class CompletionRoute:
    """The route over the front's Omni calls (`front`: app.Front)."""

    def __init__(
        self,
        front: Front,
        request_id: Callable[[Request], str],
        translate: Callable[..., Awaitable[tr.ChatPlan]],
        known: Known,
        default_model: str,
    ) -> None:
        self.front = front
        self.request_id = request_id
        self.translate = translate  # the front's body parser: (request, translate, known, **kwargs)
        self.known = known
        self.default_model = default_model

    def routes(self) -> list[Route]:
        return [Route("/v1/completions", self.complete, methods=["POST"])]

    async def complete(self, request: Request) -> Response:
        rid = self.request_id(request)
        plan = await self.translate(request, completion_request, self.known, request_id=rid)
        model = plan.model or self.default_model
        cid, created = f"cmpl-{rid or uuid.uuid4().hex}", int(time.time())
        headers = {"x-request-id": rid} if rid else {}
        opened = await self.front._open_choices(request, plan)
        if plan.stream:
            body_ = self._sse(opened, plan, cid, created, model)
            return StreamingResponse(body_, media_type="text/event-stream", headers=headers)
        results = await self.front._collect_calls(request, opened)
        choices = []
        for i, result in enumerate(results):
            err = tr.finish_error(result.finish)
            if err is not None:
                raise err
            lps = legacy_logprobs(result.logprobs, plan.top_logprobs, 0) if plan.logprobs else None
            choices.append(_choice(i, result.text, lps, tr.finish_reason(result.finish)))
        usage = ch.usage([r.finish for r in results if r.finish is not None])
        return JSONResponse(_object(cid, created, model, choices, usage), headers=headers)

    async def _sse(self, opened: list, plan: tr.ChatPlan, cid: str, created: int, model: str):
        def sse(obj: Mapping[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        finishes: list[omni_pb2.Finish] = []
        offsets = [0] * len(opened)
        events = fan_in([self.front._events(call, first) for call, first in opened])
        try:
            async for index, event in events:
                kind = event.WhichOneof("event")
                if kind == "text" and (event.text.text or event.text.logprobs):
                    lps = None
                    if plan.logprobs:
                        lps = legacy_logprobs(event.text.logprobs, plan.top_logprobs, offsets[index])
                    offsets[index] += len(event.text.text)
                    yield sse(_object(cid, created, model, [_choice(index, event.text.text, lps, None)]))
                elif kind == "finish":
                    err = tr.finish_error(event.finish)
                    if err is not None:
                        yield sse(err.body())
                        break
                    reason = tr.finish_reason(event.finish)
                    yield sse(_object(cid, created, model, [_choice(index, "", None, reason)]))
                    finishes.append(event.finish)
                    if len(finishes) == len(opened) and plan.include_usage:
                        yield sse(_object(cid, created, model, [], ch.usage(finishes)))
        except HttpError as err:
            yield sse(err.body())
        finally:
            await events.aclose()
        yield b"data: [DONE]\n\n"


def _choice(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


def _object(cid: str, created: int, model: str, choices: list, usage: dict | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = usage
    return out
