"""`POST /v1/chat/completions` and `POST /v1/completions`: a body translated, its `n` choices' Omni calls
opened, then the whole answer (JSON) or its stream (SSE)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from omnistage.common.client import Result
from omnistage.services.gateway.openai import answers, streams
from omnistage.services.gateway.openai.body import BodyReader, request_id
from omnistage.services.gateway.openai.fan_in import fan_in
from omnistage.services.gateway.openai.omni_calls import OmniCalls
from omnistage.services.gateway.openai.translate import (
    ChatPlan,
    chat_request,
    choice_requests,
    completion_request,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# (results, plan, completion_id=, created=, model=) → the whole answer's JSON.
Whole = Callable[..., dict[str, Any]]
# (plan, completion_id, created, model) → the stream's chunks.
ChunksOf = Callable[[ChatPlan, str, int, str], streams.Chunks]


class TextRoutes:
    """The two routes over the front's Omni calls; `model` is the answer's when the body names none."""

    def __init__(self, calls: OmniCalls, reader: BodyReader, model: str, allow_unknown: bool) -> None:
        self.calls = calls
        self.reader = reader
        self.model = model
        self.allow_unknown = allow_unknown

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.complete, methods=["POST"]),
        ]

    async def chat(self, request: Request) -> Response:
        return await self._answer(
            request, chat_request, answers.chat_completion, streams.ChatChunks, "chatcmpl"
        )

    async def complete(self, request: Request) -> Response:
        return await self._answer(
            request, completion_request, answers.completion_object, streams.CompletionChunks, "cmpl"
        )

    async def _answer(
        self,
        request: Request,
        translate: Callable[..., ChatPlan],
        whole: Whole,
        chunks: ChunksOf,
        prefix: str,
    ) -> Response:
        rid = request_id(request)
        plan = await self.reader.translate(
            request, translate, request_id=rid, allow_unknown=self.allow_unknown
        )
        model = plan.model or self.model
        created, completion_id = int(time.time()), f"{prefix}-{rid or uuid.uuid4().hex}"
        headers = {"x-request-id": rid} if rid else {}
        opened = await self.calls.open_choices(request, choice_requests(plan), plan.params)
        if plan.stream:
            events = fan_in([self.calls.events(one) for one in opened])
            body = streams.sse_body(events, chunks(plan, completion_id, created, model))
            return StreamingResponse(
                body, media_type="text/event-stream", headers={**streams.SSE_HEADERS, **headers}
            )
        results: list[Result] = await self.calls.collect_all(request, opened)
        for result in results:
            err = answers.finish_error(result.finish)
            if err is not None:
                raise err
        return JSONResponse(
            whole(results, plan, completion_id=completion_id, created=created, model=model), headers=headers
        )
