"""`POST /tokenize` and `POST /detokenize` (vLLM's routes) on Omni.Tokenize / Omni.Detokenize.

`/tokenize` takes `{"prompt": "..."}` (a raw prompt, as /v1/completions sends it) or a chat body's
`messages` (with `tools`, `tool_choice`): the ids are those the thinker would prefill, chat format,
default system prompt and tools block included; the answer is `{count, max_model_len, tokens}`.
`/detokenize` takes `{"tokens": [...]}` and answers `{"prompt": text}`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from omnistage.services.gateway.openai import omni_params
from omnistage.services.gateway.openai.bodies import DetokenizeBody, TokenizeBody
from omnistage.services.gateway.openai.body import BodyReader
from omnistage.services.gateway.openai.chat_body import ChatBody
from omnistage.services.gateway.openai.errors import bad_request
from omnistage.services.gateway.openai.omni_calls import metadata, rpc_error
from omnistage.services.gateway.openai.omni_params import ParamMap
from omnistage.services.gateway.openai.schema import parse
from omnistage.services.gateway.openai.translate import chat_plan
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def tokenize_request(data: Any, *, allow_unknown: bool = False) -> tuple[omni_pb2.GenerateRequest, ParamMap]:
    """The Omni request whose prompt is counted, and how its refusals name the body's fields."""
    body = parse(TokenizeBody, data, allow_unknown=allow_unknown)
    if body.add_generation_prompt is False:
        raise bad_request("add_generation_prompt", "the chat format always ends with the generation prompt")
    if body.messages is not None:
        if body.prompt is not None:
            raise bad_request("prompt", "give prompt or messages, not both")
        chat = ChatBody.model_construct(
            messages=body.messages, tools=body.tools, tool_choice=body.tool_choice
        )
        plan = chat_plan(chat)
        return plan.request, plan.params
    if not body.prompt:
        raise bad_request("prompt", "expected a non-empty string (or messages)")
    return omni_pb2.GenerateRequest(prompt=body.prompt), omni_params.TOKENIZE_PROMPT


def detokenize_request(data: Any, *, allow_unknown: bool = False) -> common_pb2.DetokenizeRequest:
    body = parse(DetokenizeBody, data, allow_unknown=allow_unknown)
    if any(not -(2**31) <= t < 2**31 for t in body.tokens):
        raise bad_request("tokens", "token ids are 32-bit")
    return common_pb2.DetokenizeRequest(token_ids=body.tokens)


class TokenRoutes:
    """The routes; `stub` calls the gateway's own Omni port with the client's API key."""

    def __init__(
        self, stub: omni_pb2_grpc.OmniStub, reader: BodyReader, timeout_s: float, allow_unknown: bool
    ) -> None:
        self.stub = stub
        self.reader = reader
        self.timeout_s = timeout_s
        self.allow_unknown = allow_unknown

    def routes(self) -> list[Route]:
        return [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]

    async def _call(
        self, method: Callable[..., Any], request: Request, message: Any, params: ParamMap
    ) -> Any:
        try:
            return await method(message, timeout=self.timeout_s, metadata=metadata(request))
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, params) from None

    async def tokenize(self, request: Request) -> Response:
        omni, params = await self.reader.translate(
            request, tokenize_request, allow_unknown=self.allow_unknown
        )
        reply = await self._call(self.stub.Tokenize, request, omni, params)
        ids = list(reply.token_ids)
        return JSONResponse({"count": len(ids), "max_model_len": reply.max_model_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        asked = await self.reader.translate(request, detokenize_request, allow_unknown=self.allow_unknown)
        reply = await self._call(self.stub.Detokenize, request, asked, omni_params.DETOKENIZE)
        return JSONResponse({"prompt": reply.text})
