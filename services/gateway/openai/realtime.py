"""`GET /v1/realtime`: the OpenAI Realtime protocol over a WebSocket, answered by one Omni.Converse
call per session through the gateway's own Omni port (the HTTP front's channel: API keys, admission,
limits, history and barge-in are those of Converse; no second request path).

The call is opened ahead of the session's first turn (prepared): once the session is configured
(`session.update`) and, failing that, when speech starts. Its opening (the gRPC call, the config
message, the Converse handler's config check and admission) is then off the path from the first
turn's end to its answer, as it is for every later turn. A session.update that changes the call's
config before any response began on it replaces the prepared call; a prepared call that fails before a
response used it is dropped unreported (the response that needs one opens its own and reports that)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from omnistage.common.runtime.deadlines import within
from omnistage.services.gateway.openai import realtime_events as rt
from omnistage.services.gateway.openai.app import INLINE_PARSE_BYTES
from omnistage.services.gateway.openai.realtime_input import (
    AheadCache,
    Heard,
    InputBuffer,
    TurnAhead,
    converse_config,
    turn_messages,
)
from omnistage.services.gateway.openai.realtime_limits import (
    RealtimeMetrics,
    RealtimeOptions,
    SessionSlots,
    key_of,
)
from omnistage.services.gateway.openai.realtime_response import Response
from omnistage.services.gateway.openai.translate import from_grpc
from omnistage.v1 import omni_pb2, omni_pb2_grpc
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

_log = logging.getLogger(__name__)

SUBPROTOCOL = "realtime"
KEY_SUBPROTOCOL = "openai-insecure-api-key."
# How long a cancelled response waits for the Converse call's Finish of its turn (its usage) before the
# session ends it without: the Finish comes within a step of the stages the turn holds.
CANCEL_FINISH_WAIT_S = 1.0
CLOSE_LIMIT, CLOSE_CAPACITY = 1008, 1013


def gone(ws: WebSocket, exc: BaseException) -> bool:
    """A real disconnect: the client closed or dropped the socket (WebSocketDisconnect), or a send or
    receive failed because the socket is closed already. Any other error is no reason to end a session."""
    if isinstance(exc, WebSocketDisconnect):
        return True
    closed = WebSocketState.DISCONNECTED in (ws.client_state, ws.application_state)
    return closed and isinstance(exc, RuntimeError | OSError)


@contextlib.contextmanager
def unless_gone(ws: WebSocket, what: str) -> Iterator[None]:
    """The block's sends, when the socket may be gone already: a disconnect is nothing to report; any
    other error is logged."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - logged: one socket's send must not end the server's loop
        if not gone(ws, exc):
            _log.exception("realtime: %s failed", what)


def _internal(exc: BaseException) -> rt.EventError:
    """The client's error for a failure of the gateway's own (logged where it happened)."""
    err = rt.EventError(f"internal error: {type(exc).__name__}", code="server_error")
    err.type = "server_error"
    return err


def credentials(ws: WebSocket) -> tuple[str, str | None]:
    """(the `authorization` value, the subprotocol to answer): the header, or the browser form
    `Sec-WebSocket-Protocol: realtime, openai-insecure-api-key.<key>`."""
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    answer = SUBPROTOCOL if SUBPROTOCOL in offered else None
    header = ws.headers.get("authorization", "")
    if header:
        return header, answer
    for p in offered:
        if p.startswith(KEY_SUBPROTOCOL):
            return f"Bearer {p[len(KEY_SUBPROTOCOL) :]}", answer
    return "", answer


class RealtimeEndpoint:
    """The ASGI WebSocket app of `/v1/realtime`; `stub` calls the gateway's own Omni port, `kept` is the
    gateway's encode cache (None: no encoding ahead), the one thing a session reaches in process."""

    def __init__(
        self,
        stub: omni_pb2_grpc.OmniStub,
        options: RealtimeOptions,
        model: str,
        check_key: Callable[[tuple], str] | None = None,
        kept: AheadCache | None = None,
    ) -> None:
        self.stub, self.options, self.model, self.check_key = stub, options, model, check_key
        self.kept = kept
        self.slots = SessionSlots(options)
        self.metrics = RealtimeMetrics()

    def turn_ahead(self, session_id: str) -> TurnAhead | None:
        """A session's encoding ahead (None: off)."""
        if self.kept is None or not self.options.encode_ahead_ms:
            return None
        return TurnAhead(self.kept, session_id, self.options.encode_ahead_ms)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ws = WebSocket(scope, receive, send)
        authorization, subprotocol = credentials(ws)
        metadata = (("authorization", authorization),) if authorization else ()
        why = self.check_key(metadata) if self.check_key is not None else ""
        if why:
            self.metrics.refused("unauthenticated")
            await _deny(ws, why)
            return
        key = key_of(authorization)
        full = self.slots.take(key)
        await ws.accept(subprotocol=subprotocol)
        if full:
            self.metrics.refused("sessions_full")
            err = rt.EventError(full, code="session_limit_reached")
            with unless_gone(ws, "refusing a session"):
                await ws.send_json(rt.error_event(err))
                await ws.close(CLOSE_CAPACITY, "too many realtime sessions")
            return
        self.metrics.session_opened()
        reason = "error"
        try:
            reason = await RealtimeSession(self, ws, metadata).run()
        finally:
            self.slots.give(key)
            self.metrics.session_closed(reason)


async def _deny(ws: WebSocket, why: str) -> None:
    """401 in the OpenAI error shape before the handshake (close 1008 where the server cannot)."""
    body = {
        "error": {"message": why, "type": "invalid_request_error", "code": "invalid_api_key", "param": None}
    }
    try:
        await ws.send_denial_response(JSONResponse(body, status_code=401))
    except RuntimeError:  # no websocket.http.response extension
        await ws.close(CLOSE_LIMIT, "unauthenticated")


def check_response_create(event: dict[str, Any], config: Any, active: Response | None, pending: bool) -> None:
    """A client's response.create is refused while a response runs or with no input since the last."""
    rt.response_options(event, config)
    if active is not None:
        raise rt.EventError(
            f"a response ({active.id}) is still in progress (cancel it first)",
            code="conversation_already_has_active_response",
        )
    if not pending:
        raise rt.EventError(
            "no user input since the last response (add an item or commit the audio buffer)",
            code="response_without_input",
        )


class RealtimeSession:
    """One socket's session (see the module's docstring)."""

    def __init__(self, endpoint: RealtimeEndpoint, ws: WebSocket, metadata: tuple) -> None:
        self.endpoint, self.ws, self.metadata = endpoint, ws, metadata
        self.options = endpoint.options
        self.id = rt.new_id("sess")
        self.conversation_id = rt.new_id("conv")
        self.config = rt.SessionConfig()
        self.input = InputBuffer(self.config.vad, endpoint.turn_ahead(self.id))
        self.pending: list[rt.UserItem] = []
        self.last_item: str | None = None
        self.call: grpc.aio.StreamStreamCall | None = None
        self.call_fields: tuple | None = None
        self.begun = False  # a response began on the call: its config is fixed (else prepared ahead)
        self.reader: asyncio.Task | None = None
        self.turns_sent = 0
        self.active: Response | None = None
        self.spoken: dict[str, int] = {}  # assistant item id -> audio samples sent (for truncate)
        self._send_lock = asyncio.Lock()

    # ---- the socket

    async def send(self, event: dict[str, Any], unless_done: Response | None = None) -> None:
        """Send `event`; with `unless_done`, not once that response is done (checked in turn, so no
        delta of a response follows its `response.done`)."""
        async with self._send_lock:
            if unless_done is None or not unless_done.done:
                await self.ws.send_json(event)

    async def run(self) -> str:
        """The session until its socket goes (or a limit ends it); why it ended."""
        try:
            await self.send(rt.event("session.created", session=self._session()))
            async with asyncio.timeout(self.options.max_session_s):
                return await self._serve()
        except TimeoutError:
            await self._end(
                "session_expired",
                f"the session reached {self.options.max_session_s:g} s (gateway.realtime_max_session_s)",
            )
            return "session_length"
        except Exception as exc:
            if gone(self.ws, exc):
                return "client"
            _log.exception("realtime session %s failed", self.id)
            await self._end("server_error", f"the session failed: {type(exc).__name__}")
            return "error"
        finally:
            self.input.close()
            await self._close_call()

    async def _end(self, code: str, message: str) -> None:
        with unless_gone(self.ws, f"ending session {self.id}"):
            await self.send(rt.error_event(rt.EventError(message, code=code)))
            await self.ws.close(CLOSE_LIMIT, code)

    async def _serve(self) -> str:
        idle_s = self.options.idle_timeout_s
        while True:
            try:
                message = await within(self.ws.receive(), idle_s)
            except TimeoutError:
                if self.active is not None:
                    continue  # answering is not idle
                await self._end(
                    "idle_timeout", f"no event for {idle_s:g} s (gateway.realtime_idle_timeout_s)"
                )
                return "idle"
            if message["type"] == "websocket.disconnect":
                return "client"
            raw = message.get("text") if message.get("text") is not None else message.get("bytes")
            event = None
            try:
                # A large event (audio) is parsed in a worker thread: the loop serves the gateway's API.
                large = len(raw or b"") >= INLINE_PARSE_BYTES
                event = await asyncio.to_thread(rt.parse, raw) if large else rt.parse(raw or b"")
                await self._handle(event)
            except rt.EventError as err:
                await self.send(rt.error_event(rt.with_event_id(err, event)))
            except Exception as exc:
                if gone(self.ws, exc):
                    raise
                # A bug handling one event: said and logged; the session goes on.
                _log.exception("realtime session %s: handling %s failed", self.id, (event or {}).get("type"))
                await self.send(rt.error_event(rt.with_event_id(_internal(exc), event)))

    async def _handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "session.update":
            await self._session_update(event)
        elif kind == "input_audio_buffer.append":
            await self._append(event)
        elif kind == "input_audio_buffer.commit":
            await self._commit(event)
        elif kind == "input_audio_buffer.clear":
            self.input.clear()
            await self.send(rt.event("input_audio_buffer.cleared"))
        elif kind == "conversation.item.create":
            o = self.options
            await self._add_item(rt.user_item(event, o.max_turn_chars, o.max_buffer_bytes, o.buffer_knob))
        elif kind == "conversation.item.truncate":
            await self._truncate(event)
        elif kind == "response.create":
            check_response_create(event, self.config, self.active, bool(self.pending))
            await self._respond("client")
        elif kind == "response.cancel":
            if self.active is None:
                raise rt.EventError("no response is in progress", code="response_cancel_not_active")
            await self._cancel("client_cancelled")

    # ---- session and input audio

    def _session(self) -> dict[str, Any]:
        return rt.session_object(self.id, self.endpoint.model, self.config)

    async def _session_update(self, event: dict[str, Any]) -> None:
        config = rt.session_update(event, self.config, self.options.max_prompt_chars)
        if self.call is not None and config.conversation_fields() != self.call_fields:
            if self.begun:
                raise rt.EventError(
                    "session: instructions, voice, output_modalities and max_output_tokens are fixed once "
                    "the conversation has begun (its first response)",
                    code="session_locked",
                    param="session",
                )
            await self._close_call()  # prepared with the old config: the new one is prepared below
        self.input.set_vad(config.vad)
        self.config = config
        await self.send(rt.event("session.updated", session=self._session()))
        await self._prepare_call()

    async def _append(self, event: dict[str, Any]) -> None:
        o = self.options
        try:
            pcm = rt.audio_bytes(
                event.get("audio"), "audio", o.max_buffer_bytes, held=len(self.input), knob=o.buffer_knob
            )
        except rt.EventError as err:
            if err.code == "input_audio_buffer_full":
                # The turn it belonged to is too long: dropped, with the rest of it (no second
                # speech_started for the same utterance).
                self.input.drop_turn()
                err.message += "; the turn's audio was dropped"
            raise
        for heard in await self.input.append(pcm):
            self.endpoint.metrics.vad(heard.started)
            if heard.started:
                await self._speech_started(heard)
            else:
                await self._speech_stopped(heard)

    async def _speech_started(self, heard: Heard) -> None:
        await self.send(
            rt.event("input_audio_buffer.speech_started", audio_start_ms=heard.ms, item_id=heard.item_id)
        )
        if self.active is not None and self.config.vad.interrupt_response:
            self.endpoint.metrics.barge_in()
            await self._cancel("turn_detected")
        await self._prepare_call()  # a turn is coming: its call is open before it ends

    async def _speech_stopped(self, heard: Heard) -> None:
        await self.send(
            rt.event("input_audio_buffer.speech_stopped", audio_end_ms=heard.ms, item_id=heard.item_id)
        )
        await self._add_committed(rt.UserItem(heard.item_id, pcm16=heard.pcm))
        if self.config.vad.create_response:
            if self.active is not None:  # interrupt_response false: the newer turn supersedes it now
                await self._cancel("turn_detected")
            await self._respond("server_vad")

    async def _commit(self, event: dict[str, Any]) -> None:
        await self._add_committed(rt.UserItem(rt.new_id("item"), pcm16=self.input.commit()))

    async def _add_committed(self, item: rt.UserItem) -> None:
        await self.send(
            rt.event("input_audio_buffer.committed", previous_item_id=self.last_item, item_id=item.item_id)
        )
        await self._add_item(item)

    async def _add_item(self, item: rt.UserItem) -> None:
        body = rt.user_item_object(item)
        await self.send(rt.event("conversation.item.created", previous_item_id=self.last_item, item=body))
        self.last_item = item.item_id
        self.pending.append(item)
        if item.pcm16:  # its encoding starts now (if it has not: VAD's turns started theirs before)
            self.input.encode(item.pcm16)

    async def _truncate(self, event: dict[str, Any]) -> None:
        item_id, ms = rt.truncation(event, self.spoken)
        self.spoken[item_id] = ms * rt.RATE // 1000
        await self.send(
            rt.event("conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=ms)
        )

    # ---- responses through the Converse call

    async def _respond(self, trigger: str) -> None:
        items, self.pending = self.pending, []
        fresh = self.call is None
        response = Response(self, (0 if fresh else self.turns_sent) + len(items) - 1, trigger)
        self.active = response
        self.begun = True  # the call's config is the conversation's from here on, prepared or not
        self.endpoint.metrics.response_started(trigger)
        await response.begin()
        try:
            await self._open_call()
            for item in items:
                await self._write_item(item)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            _log.info("realtime session %s: the conversation stopped taking turns: %s", self.id, exc)

    async def _write_item(self, item: rt.UserItem) -> None:
        assert self.call is not None
        for message in turn_messages(item):
            await self.call.write(message)
        self.turns_sent += 1

    async def _prepare_call(self) -> None:
        """Open the Converse call ahead of the first turn (the module's docstring), if none is open."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            await self._open_call()  # failing here: the response that needs the call opens its own

    async def _open_call(self) -> None:
        if self.call is not None:
            return
        self.call = self.endpoint.stub.Converse(
            metadata=self.metadata, timeout=self.options.max_session_s + 30.0
        )
        self.call_fields, self.turns_sent = self.config.conversation_fields(), 0
        # Reading first: a call refused at once is reported by the reader like any failed call.
        self.reader = asyncio.create_task(self._read_call(self.call), name=f"realtime-{self.id}")
        await self.call.write(converse_config(self.id, self.config))

    async def _read_call(self, call: grpc.aio.StreamStreamCall) -> None:
        """The Converse call's events to the response they answer; its end (an error, a close) to the client."""
        try:
            while (event := await call.read()) is not grpc.aio.EOF:
                await self._on_call_event(event)
            err = rt.EventError("the conversation ended", code="conversation_ended")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self.call is not call:
                return
            err = rt.EventError(exc.details() or exc.code().name, code=exc.code().name.lower())
            err.type = from_grpc(exc.code(), exc.details()).type  # as the HTTP front types it
        except Exception as exc:
            if gone(self.ws, exc):
                return  # the socket went: the session's end closes the call
            _log.exception("realtime session %s: reading its conversation failed", self.id)
            err = _internal(exc)
        if self.call is call:
            self.call = None
            if not self.begun:  # prepared, no response used it: the next one opens another
                _log.info("realtime session %s: its prepared conversation ended: %s", self.id, err.message)
                return
            self.begun = False
            with unless_gone(self.ws, f"ending the conversation of session {self.id}"):
                if self.active is not None:
                    await self.active.fail(err)
                await self.send(rt.error_event(err))

    async def _on_call_event(self, event: omni_pb2.GenerateEvent) -> None:
        """One event of the call to its turn's response; a response failing on it (a bug) fails, logged."""
        response = self.active
        if response is None or event.turn != response.turn:
            return
        try:
            await response.on_event(event)
        except Exception as exc:
            if gone(self.ws, exc):
                raise
            _log.exception("realtime session %s: response %s failed on an event", self.id, response.id)
            await response.fail(_internal(exc))

    async def _cancel(self, reason: str) -> None:
        """Cancel the response in progress: its turn's Finish ends it (with usage), or the session does later."""
        response = self.active
        if response is None:
            return
        response.cancel_reason = reason
        if self.call is not None:
            with contextlib.suppress(
                grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError, TimeoutError
            ):
                await self.call.write(omni_pb2.ConverseRequest(cancel=True))
                async with asyncio.timeout(CANCEL_FINISH_WAIT_S):
                    await response.ended.wait()
        await response.cancelled(reason)  # no Finish came in time (nothing when it did)

    async def _close_call(self) -> None:
        call, self.call, self.begun = self.call, None, False
        if self.active is not None:
            self.active.abandon()
        if call is not None:
            call.cancel()  # the Converse call ends: its stage streams with it
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)
