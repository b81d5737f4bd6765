"""`POST /tokenize` and `POST /detokenize` (vLLM's routes) on Omni.Tokenize / Omni.Detokenize.

`/tokenize` takes `{"prompt": "..."}` (a raw prompt, as /v1/completions sends it) or a chat body's
`messages` (with `tools`, `tool_choice`): the ids are those the thinker would prefill, chat format,
default system prompt and tools block included; the answer is `{count, max_model_len, tokens}`.
`/detokenize` takes `{"tokens": [...]}` and answers `{"prompt": text}`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from omnistage.services.gateway.openai import translate as tr
from omnistage.services.gateway.openai.fields import Known
from omnistage.services.gateway.openai.translate import bad_request
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "tools", "tool_choice", "add_generation_prompt", "add_special_tokens"}
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize_request(body: Any) -> omni_pb2.GenerateRequest:
    """The Omni request whose prompt is counted (HttpError 400 naming the field)."""
    tr._expect(body, dict, "body", "a JSON object")
    if body.get("add_generation_prompt") is False:
        raise bad_request("add_generation_prompt", "the chat format always ends with the generation prompt")
    tr._boolean(body.get("add_special_tokens"), "add_special_tokens")  # nothing is added either way
    if "messages" in body:
        if "prompt" in body:
            raise bad_request("prompt", "give prompt or messages, not both")
        return tr.chat_request(
            {k: body[k] for k in ("messages", "tools", "tool_choice") if k in body}
        ).request
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("prompt", "expected a non-empty string (or messages)")
    return omni_pb2.GenerateRequest(prompt=prompt)


def detokenize_request(body: Any) -> common_pb2.DetokenizeRequest:
    tr._expect(body, dict, "body", "a JSON object")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise bad_request("tokens", "expected a list of token ids")
    if any(not -(2**31) <= t < 2**31 for t in tokens):
        raise bad_request("tokens", "token ids are 32-bit")
    return common_pb2.DetokenizeRequest(token_ids=tokens)


class TokenRoutes:
    """The routes; `stub` calls the gateway's own Omni port with the client's `metadata(request)`;
    `translate` is the front's body parser: (request, translate, known, **kwargs)."""

    def __init__(
        self,
        stub: omni_pb2_grpc.OmniStub,
        metadata: Callable[[Request], tuple],
        translate: Callable[..., Awaitable[Any]],
        known: Callable[[frozenset[str]], Known],
        timeout_s: float,
    ) -> None:
        self.stub = stub
        self.metadata = metadata
        self.translate = translate
        self.known = known
        self.timeout_s = timeout_s

    def routes(self) -> list[Route]:
        return [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]

    async def _call(self, method: Callable[..., Any], request: Request, message: Any) -> Any:
        try:
            return await method(message, timeout=self.timeout_s, metadata=self.metadata(request))
        except grpc.aio.AioRpcError as exc:
            raise tr.from_grpc(exc.code(), exc.details(), exc.trailing_metadata()) from None

    async def tokenize(self, request: Request) -> Response:
        omni = await self.translate(request, tokenize_request, self.known(TOKENIZE_FIELDS))
        reply = await self._call(self.stub.Tokenize, request, omni)
        ids = list(reply.token_ids)
        return JSONResponse({"count": len(ids), "max_model_len": reply.max_model_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        asked = await self.translate(request, detokenize_request, self.known(DETOKENIZE_FIELDS))
        reply = await self._call(self.stub.Detokenize, request, asked)
        return JSONResponse({"prompt": reply.text})
