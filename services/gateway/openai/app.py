"""The Starlette application of the OpenAI-compatible front."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.request_ids import MAX_REQUEST_ID_CHARS, valid_request_id
from omnistage.common.runtime.deadlines import cancel_and_wait, within
from omnistage.common.runtime.server import PUBLIC_API
from omnistage.services.gateway.openai import choices, completions, fields
from omnistage.services.gateway.openai import translate as tr
from omnistage.services.gateway.openai.completions import CompletionRoute
from omnistage.services.gateway.openai.extras_routes import ExtraRoutes
from omnistage.services.gateway.openai.fan_in import fan_in
from omnistage.services.gateway.openai.tokens_routes import TokenRoutes
from omnistage.services.gateway.openai.transcriptions import TranscriptionRoute
from omnistage.services.gateway.openai.translate import HttpError
from omnistage.v1 import omni_pb2, omni_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Bodies from this size on are parsed off the event loop.
INLINE_PARSE_BYTES = 256 * 1024
# The most '{', '[' and ',' a body may hold (strings included), counted before it is parsed: json.loads
# holds the GIL, even in a worker thread, for ~0.25 s per million values, so `[{},{},...]` of 8 M
# messages would stall the event loop ~2 s. The largest request the gateway takes (max_messages x
# max_parts_per_message parts) needs ~50 k; base64 media has none.
MAX_JSON_VALUES = 500_000
T = TypeVar("T")


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
    # Take bodies with top-level fields OpenAI's schema does not have (else 400 naming them).
    allow_unknown_fields: bool = False


def error_response(err: HttpError, request_id: str = "") -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


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


def _loads(raw: bytes) -> Any:
    if not raw:
        raise HttpError(400, "body: expected a JSON object", param="body")
    values = raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if values > MAX_JSON_VALUES:
        raise HttpError(
            400, f"body: {values} JSON objects, arrays and commas, at most {MAX_JSON_VALUES}", param="body"
        )
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HttpError(400, f"body: not valid JSON: {exc}", param="body") from None
    except RecursionError:
        raise HttpError(400, "body: JSON nested too deeply", param="body") from None


JSON_MEDIA_TYPE = "application/json"


def _require_json(request: Request) -> None:
    """Bodies are JSON and say so: a form or text body is refused, not parsed on a guess."""
    value = request.headers.get("content-type", "")
    if value.partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
        got = f"got {value!r}" if value else "no Content-Type was sent"
        raise HttpError(
            400,
            f"content-type: expected {JSON_MEDIA_TYPE}, {got}",
            param="content-type",
            code="invalid_content_type",
        )


async def _translate(request: Request, translate: Callable[..., T], known: fields.Known, **kwargs: Any) -> T:
    """`translate(body, **kwargs)` of the request's JSON body, its top-level fields checked against
    `known` first. A large body (base64 media) is parsed and decoded in a worker thread: the event loop
    also serves the gateway's gRPC API."""
    _require_json(request)
    raw = await request.body()

    def parsed() -> T:
        body = _loads(raw)
        fields.check_fields(body, known)
        return translate(body, **kwargs)

    if len(raw) < INLINE_PARSE_BYTES:
        return parsed()
    return await asyncio.to_thread(parsed)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (call once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
    value = request.headers.get("authorization")
    return (("authorization", value),) if value else ()


def _request_id(request: Request) -> str:
    """The client's `x-request-id` ("" when none was sent); an invalid one is refused, not replaced."""
    rid = request.headers.get("x-request-id", "")
    if not valid_request_id(rid):
        raise HttpError(
            400,
            f"x-request-id: must be printable and at most {MAX_REQUEST_ID_CHARS} characters",
            param="x-request-id",
            code="invalid_value",
        )
    return rid


def _echoed_request_id(request: Request) -> str:
    """The `x-request-id` an error response repeats: the client's when it is valid, else none."""
    rid = request.headers.get("x-request-id", "")
    return rid if valid_request_id(rid) else ""


class Front:
    """The routes; `channel` is a grpc.aio channel to the gateway's own Omni port."""

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
        self.check_key = check_key  # refusal(metadata) of the API keys, for routes that call no Omni RPC
        self.created = int(time.time())
        self.realtime = realtime  # the /v1/realtime WebSocket app (realtime.py), when served

    def app(self) -> ASGIApp:
        routes = [
            Route("/health", self.health_route, methods=["GET"]),
            Route("/ready", self.ready_route, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/audio/speech", self.speech, methods=["POST"]),
            Route("/v1/images/generations", self.images, methods=["POST"]),
            *ExtraRoutes(self._authorize).routes(),
            *TranscriptionRoute(self._collect, _request_id, self.options.allow_unknown_fields).routes(),
            *CompletionRoute(
                self, _request_id, _translate, self._known(completions.FIELDS), self.options.model
            ).routes(),
            *TokenRoutes(self.stub, _metadata, _translate, self._known, self.options.timeout_s).routes(),
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
        return BodyLimit(app, self.options.max_body_bytes)

    async def _on_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HttpError)
        return error_response(exc, _echoed_request_id(request))

    async def _on_bug(self, request: Request, exc: Exception) -> Response:
        _log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(HttpError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return error_response(
            HttpError(404, f"no route {request.method} {request.url.path}", type="not_found_error")
        )

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return error_response(HttpError(405, f"{request.method} is not allowed on {request.url.path}"))

    # ---- health and models

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

    def _known(self, route_fields: frozenset[str]) -> fields.Known:
        """The fields a route takes; every field when `allow_unknown_fields`."""
        return fields.ANY if self.options.allow_unknown_fields else route_fields

    def _authorize(self, request: Request) -> None:
        if self.check_key is not None:
            why = self.check_key(_metadata(request))
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

    # ---- the Omni call

    async def _open(self, request: Request, omni: omni_pb2.GenerateRequest):
        """(call, first event) of an Omni Generate; HttpError when it is refused before any event."""
        call = self.stub.Generate(omni, timeout=self.options.timeout_s, metadata=_metadata(request))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise tr.from_grpc(exc.code(), exc.details(), exc.trailing_metadata()) from None
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise HttpError(502, "the gateway's stream ended without an event", type="server_error")
        return call, first

    async def _events(self, call, first) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """first, then the rest of the stream; an RPC error becomes HttpError; the call ends with it.
        Left after the finish, the call gets its own end (OK) first; left before, it is cancelled (the
        client went away: the stages stop)."""
        finished = False
        try:
            event = first
            while event is not grpc.aio.EOF:
                finished = finished or event.WhichOneof("event") == "finish"
                yield event
                event = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise tr.from_grpc(exc.code(), exc.details(), exc.trailing_metadata()) from None
        finally:
            try:
                if finished:
                    with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                        await within(call.code(), self.options.finished_stream_end_s)
            finally:
                call.cancel()  # a no-op on a call that ended

    async def _collect(self, request: Request, omni: omni_pb2.GenerateRequest) -> tr.Result:
        """The whole answer of a non-streamed response."""
        return (await self._collect_calls(request, [await self._open(request, omni)]))[0]

    async def _collect_calls(self, request: Request, opened: list) -> list[tr.Result]:
        """The whole answers of opened calls ((call, first event) each). A client that disconnects
        meanwhile cancels them (an image or a long answer is not made for nobody); the first failure
        of one cancels the others."""
        collected = [tr.Result() for _ in opened]

        async def fill(result: tr.Result, call, first) -> None:
            async for event in self._events(call, first):
                result.add(event)

        async def gather() -> None:
            try:
                async with asyncio.TaskGroup() as group:
                    for result, (call, first) in zip(collected, opened, strict=True):
                        group.create_task(fill(result, call, first))
            except ExceptionGroup as failed:
                raise failed.exceptions[0] from None

        work, gone = asyncio.ensure_future(gather()), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            left = not work.done()  # the client went away (or this task is being cancelled)
            if left:
                for call, _ in opened:
                    call.cancel()
                await cancel_and_wait(
                    [work], self.options.finished_stream_end_s, "openai front: a left answer"
                )
        if left:
            raise HttpError(499, "the client went away", type="cancelled", code="cancelled")
        work.result()  # an RPC error as HttpError
        if any(result.finish is None for result in collected):
            raise HttpError(502, "the gateway's stream ended without a finish event", type="server_error")
        return collected

    async def _open_choices(self, request: Request, plan: tr.ChatPlan) -> list:
        """(call, first event) of each choice: the first alone, the others once its prompt is computed
        (choices.py); a refusal of any cancels those opened."""
        requests = choices.choice_requests(plan)
        opened = [await self._open(request, requests[0])]
        if len(requests) == 1:
            return opened
        try:
            rest = await asyncio.gather(
                *(self._open(request, r) for r in requests[1:]), return_exceptions=True
            )
        except BaseException:  # this task is cancelled (each _open cancels its own call)
            opened[0][0].cancel()
            raise
        failed = [r for r in rest if isinstance(r, BaseException)]
        opened += [r for r in rest if not isinstance(r, BaseException)]
        if failed:
            for call, _ in opened:
                call.cancel()
            raise failed[0]
        return opened

    # ---- /v1/chat/completions

    async def chat(self, request: Request) -> Response:
        rid = _request_id(request)
        plan = await _translate(request, tr.chat_request, self._known(fields.CHAT), request_id=rid)
        model = plan.model or self.options.model
        created = int(time.time())
        completion_id = f"chatcmpl-{rid or uuid.uuid4().hex}"
        headers = {"x-request-id": rid} if rid else {}
        opened = await self._open_choices(request, plan)
        if not plan.stream:
            results = await self._collect_calls(request, opened)
            for result in results:
                err = tr.finish_error(result.finish)
                if err is not None:
                    raise err
            body = choices.completion(
                results, plan, completion_id=completion_id, created=created, model=model
            )
            return JSONResponse(body, headers=headers)
        return StreamingResponse(
            self._chat_sse(opened, plan, completion_id, created, model),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **headers},
        )

    async def _chat_sse(
        self, opened: list, plan: tr.ChatPlan, completion_id: str, created: int, model: str
    ) -> AsyncIterator[bytes]:
        def sse(obj: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs=None) -> bytes:
            return sse(choices.chunk(completion_id, created, model, index, delta, finish, logprobs))

        audio = tr.AudioDeltas(f"audio-{completion_id}", plan.audio_format) if plan.audio_format else None
        for index in range(len(opened)):
            yield chunk(index, {"role": "assistant", "content": ""})
        finishes: list[omni_pb2.Finish] = []
        calls = [0] * len(opened)  # tool calls streamed so far, per choice
        events = fan_in([self._events(call, first) for call, first in opened])
        try:
            async for index, event in events:
                kind = event.WhichOneof("event")
                if kind == "text" and (event.text.text or event.text.logprobs):
                    lps = choices.logprobs_object(plan, event.text.logprobs)
                    yield chunk(index, {"content": event.text.text}, logprobs=lps)
                elif kind == "tool_call":
                    yield chunk(index, {"tool_calls": [tr.tool_call(event.tool_call, calls[index])]})
                    calls[index] += 1
                elif kind == "audio" and audio is not None:
                    delta = audio.delta(event.audio)
                    if delta is not None:
                        yield chunk(index, {"audio": delta})
                elif kind == "finish":
                    finish = event.finish
                    err = tr.finish_error(finish)
                    if err is not None:
                        yield sse(err.body())
                        break
                    delta: dict[str, Any] = {}
                    if audio is not None:
                        delta["audio"] = {"id": audio.audio_id, **tr.audio_status(finish.audio)}
                    yield chunk(index, delta, tr.finish_reason(finish))
                    finishes.append(finish)
                    if len(finishes) == len(opened) and plan.include_usage:
                        yield sse(
                            tr.chunk(completion_id, created, model, None, usage_=choices.usage(finishes))
                        )
        except HttpError as err:
            yield sse(err.body())
        finally:
            await events.aclose()  # the client left: the stages stop now
        yield b"data: [DONE]\n\n"

    # ---- /v1/audio/speech

    async def speech(self, request: Request) -> Response:
        rid = _request_id(request)
        plan = await _translate(
            request,
            tr.speech_request,
            self._known(fields.SPEECH),
            request_id=rid,
            max_chars=self.options.max_speech_chars,
        )
        call, first = await self._open(request, plan.request)
        events = self._events(call, first)
        # The status waits for the first audio (or the end): an answer with no speech gets an error.
        pending: omni_pb2.AudioChunk | None = None
        try:
            async for event in events:
                kind = event.WhichOneof("event")
                if kind == "audio" and event.audio.pcm16:
                    pending = event.audio
                    break
                if kind == "finish":
                    raise tr.finish_error(event.finish) or tr.speech_error(event.finish.audio)
            if pending is None:
                raise HttpError(
                    502, "the gateway's stream ended without audio or a finish event", type="server_error"
                )
        except BaseException:
            await events.aclose()
            raise
        rate = pending.sample_rate_hz
        headers = {"x-sample-rate": str(rate), **({"x-request-id": rid} if rid else {})}
        if plan.sse:
            body = self._speech_sse(pending, events)
            return StreamingResponse(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        media = tr.SPEECH_FORMATS[plan.response_format]
        if plan.response_format == "pcm":
            media = f"audio/pcm;rate={rate}"
        return StreamingResponse(
            self._speech_bytes(pending, events, plan.response_format), media_type=media, headers=headers
        )

    @staticmethod
    async def _speech_bytes(first: omni_pb2.AudioChunk, events, fmt: str) -> AsyncIterator[bytes]:
        yield (tr.wav_header(first.sample_rate_hz) if fmt == "wav" else b"") + first.pcm16
        try:
            async for event in events:
                if event.WhichOneof("event") == "audio" and event.audio.pcm16:
                    yield event.audio.pcm16
        except HttpError as err:  # the status is sent: the body ends short, and the log says why
            _log.warning("speech stream ended early: %s", err.message)
        finally:
            await events.aclose()

    @staticmethod
    async def _speech_sse(first: omni_pb2.AudioChunk, events) -> AsyncIterator[bytes]:
        def sse(obj: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        yield sse(
            {
                "type": "speech.audio.delta",
                "audio": base64.b64encode(first.pcm16).decode(),
                "sample_rate": first.sample_rate_hz,
            }
        )
        try:
            async for event in events:
                kind = event.WhichOneof("event")
                if kind == "audio" and event.audio.pcm16:
                    yield sse(
                        {"type": "speech.audio.delta", "audio": base64.b64encode(event.audio.pcm16).decode()}
                    )
                elif kind == "finish":
                    u = tr.usage(event.finish)
                    yield sse(
                        {
                            "type": "speech.audio.done",
                            "usage": {
                                "input_tokens": u["prompt_tokens"],
                                "output_tokens": u["completion_tokens"],
                                "total_tokens": u["total_tokens"],
                            },
                            "audio": tr.audio_status(event.finish.audio),
                        }
                    )
        except HttpError as err:
            yield sse({"type": "error", **err.body()})
        finally:
            await events.aclose()

    # ---- /v1/images/generations

    async def images(self, request: Request) -> Response:
        rid = _request_id(request)
        omni = await _translate(request, tr.image_request, self._known(fields.IMAGES), request_id=rid)
        collected = await self._collect(request, omni)
        err = tr.finish_error(collected.finish)
        if err is not None:
            raise err
        if not collected.images:
            raise HttpError(
                500, "the request finished without an image", type="server_error", code="no_image"
            )
        data = [
            {"b64_json": base64.b64encode(img.png).decode(), "revised_prompt": None}
            for img in collected.images
        ]
        first = collected.images[0]
        body = {
            "created": int(time.time()),
            "data": data,
            "output_format": "png",
            "size": f"{first.width}x{first.height}",
            "usage": {
                "input_tokens": collected.finish.usage.prompt_tokens,
                "output_tokens": 0,
                "total_tokens": collected.finish.usage.prompt_tokens,
            },
        }
        return JSONResponse(body, headers={"x-request-id": rid} if rid else {})
