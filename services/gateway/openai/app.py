"""The Starlette application of the OpenAI-compatible front: its routes, its errors in OpenAI's shape,
the body bound, and the routes that call no model (health, readiness, models)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.runtime.server import PUBLIC_API
from omnistage.services.gateway.openai.body import (
    INLINE_PARSE_BYTES as INLINE_PARSE_BYTES,  # realtime.py's import
)
from omnistage.services.gateway.openai.body import (
    MAX_JSON_VALUES as MAX_JSON_VALUES,  # realtime_events.py's import
)
from omnistage.services.gateway.openai.body import (
    MAX_LARGE_BYTES,
    MAX_LARGE_VALUES,
    PARSE_THREADS,
    BodyReader,
    LargeBodies,
    echoed_request_id,
    request_id,
)
from omnistage.services.gateway.openai.errors import HttpError, error_response
from omnistage.services.gateway.openai.extras_routes import ExtraRoutes
from omnistage.services.gateway.openai.media_routes import MediaRoutes
from omnistage.services.gateway.openai.omni_calls import OmniCalls, metadata
from omnistage.services.gateway.openai.text_routes import TextRoutes
from omnistage.services.gateway.openai.tokens_routes import TokenRoutes
from omnistage.services.gateway.openai.transcriptions import TranscriptionRoute
from omnistage.v1 import omni_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontOptions:
    model: str = "ming-flash-omni-2.0"
    # Deadline of each Omni call, in seconds.
    timeout_s: float = 600.0
    # Largest request body, in bytes (413 above).
    max_body_bytes: int = 96 * 1024 * 1024
    # Longest /v1/audio/speech input, in characters.
    max_speech_chars: int = 4096
    # How long /ready waits for the gateway's health answer, in seconds.
    health_timeout_s: float = 2.0
    # The gateway's deployed capabilities (text, media_input, speech, image_output): /ready reports each,
    # read from the health names omnistage.v1.Omni.<capability>.
    capabilities: tuple[str, ...] = ()
    # After an answer's finish, how long its Omni call may take to end by itself (status OK) before it
    # is cancelled.
    finished_stream_end_s: float = 5.0
    # Take bodies with fields OpenAI's schema does not have, at any level, ignoring them (else 400 naming them).
    allow_unknown_fields: bool = False
    # Threads parsing and translating large bodies (body.py), and their bytes and JSON values in flight
    # together (429 beyond).
    parse_threads: int = PARSE_THREADS
    max_large_body_bytes: int = MAX_LARGE_BYTES
    max_large_body_values: int = MAX_LARGE_VALUES


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413 (by Content-Length, or while it arrives)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = HttpError(
            413,
            f"request body larger than {self.limit} bytes (gateway.http_max_body_bytes)",
            code="request_too_large",
        )
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    if int(value) > self.limit:
                        await error_response(too_large)(scope, receive, send)
                        return
                except ValueError:
                    pass
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_large  # the app's HttpError handler answers 413
            return message

        await self.app(scope, limited, send)


class Front:
    """The application; `channel` is a grpc.aio channel to the gateway's own Omni port, `check_key`
    the API keys' refusal of a request's metadata (for routes that call no Omni RPC)."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        options: FrontOptions = FrontOptions(),
        check_key: Callable[[tuple], str] | None = None,
        realtime: ASGIApp | None = None,
    ) -> None:
        self.stub = omni_pb2_grpc.OmniStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.options = options
        self.check_key = check_key
        self.created = int(time.time())
        self.realtime = realtime  # the /v1/realtime WebSocket app (realtime.py), when served
        self.calls = OmniCalls(self.stub, options.timeout_s, options.finished_stream_end_s)
        self.large_bodies = LargeBodies(
            options.parse_threads, options.max_large_body_bytes, options.max_large_body_values
        )

    def app(self) -> ASGIApp:
        o = self.options
        reader = BodyReader(self.large_bodies)
        routes = [
            Route("/health", self.health_route, methods=["GET"]),
            Route("/ready", self.ready_route, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            *TextRoutes(self.calls, reader, o.model, o.allow_unknown_fields).routes(),
            *MediaRoutes(self.calls, reader, o.max_speech_chars, o.allow_unknown_fields).routes(),
            *ExtraRoutes(self._authorize).routes(),
            *TranscriptionRoute(self.calls.collect, request_id, o.allow_unknown_fields).routes(),
            *TokenRoutes(self.stub, reader, o.timeout_s, o.allow_unknown_fields).routes(),
        ]
        if self.realtime is not None:
            routes.append(WebSocketRoute("/v1/realtime", self.realtime))
        app = Starlette(
            routes=routes,
            exception_handlers={
                HttpError: self._on_error,
                404: self._not_found,
                405: self._not_allowed,
                Exception: self._on_bug,
            },
        )
        return BodyLimit(app, o.max_body_bytes)

    def close(self) -> None:
        self.large_bodies.close()

    async def _on_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HttpError)
        return error_response(exc, echoed_request_id(request))

    async def _on_bug(self, request: Request, exc: Exception) -> Response:
        _log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(HttpError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return error_response(
            HttpError(404, f"no route {request.method} {request.url.path}", type="not_found_error")
        )

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return error_response(HttpError(405, f"{request.method} is not allowed on {request.url.path}"))

    async def health_route(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _health_of(self, service: str) -> str:
        """The gateway's health of `service` ("" = the gateway): SERVING, NOT_SERVING, or CODE: details."""
        try:
            reply = await self.health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.options.health_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def ready_route(self, request: Request) -> Response:
        """200 when the gateway serves text (the thinker is admitted) and, with `?capability=NAME`, that
        capability is ready too (e.g. speech once the talker is admitted); the body gives each deployed
        capability's readiness."""
        caps = self.options.capabilities
        wanted = request.query_params.get("capability", "text" if "text" in caps else None)
        if wanted is not None and wanted not in caps:
            raise HttpError(
                404,
                f"capability: {wanted!r} is not deployed here (have: {', '.join(caps) or 'none'})",
                type="not_found_error",
                param="capability",
                code="capability_not_found",
            )
        answers = await asyncio.gather(
            self._health_of(""), *(self._health_of(f"{PUBLIC_API}.{c}") for c in caps)
        )
        gateway, ready = answers[0], {c: a == "SERVING" for c, a in zip(caps, answers[1:], strict=True)}
        ok = gateway == "SERVING" and (wanted is None or ready[wanted])
        body: dict[str, Any] = {
            "status": "ready" if ok else "not_ready",
            "gateway": gateway,
            "capabilities": ready,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    def _authorize(self, request: Request) -> None:
        if self.check_key is not None:
            why = self.check_key(metadata(request))
            if why:
                raise HttpError(401, why, type="authentication_error", code="unauthenticated")

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.options.model, "object": "model", "created": self.created, "owned_by": "omnistage"}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        if request.path_params["model"] != self.options.model:
            raise HttpError(
                404,
                f"model {request.path_params['model']!r} not found (serving {self.options.model!r})",
                type="not_found_error",
                code="model_not_found",
            )
        return JSONResponse(self._model_card())
