"""`GET /v1/realtime`: the OpenAI Realtime protocol over a WebSocket, answered by one Omni.Converse
call per session through the gateway's own Omni port (the HTTP front's channel: API keys, admission,
limits, history and barge-in are those of Converse; no second request path)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import grpc
from omnistage.common.runtime.deadlines import within
from omnistage.services.gateway.openai import realtime_events as rt
from omnistage.services.gateway.openai.app import INLINE_PARSE_BYTES
from omnistage.services.gateway.openai.realtime_limits import (
    RealtimeMetrics,
    RealtimeOptions,
    SessionSlots,
    key_of,
)
from omnistage.services.gateway.openai.realtime_response import Response
from omnistage.services.gateway.openai.translate import from_grpc
from omnistage.services.gateway.openai.vad import TurnDetector
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

_log = logging.getLogger(__name__)

SUBPROTOCOL = "realtime"
KEY_SUBPROTOCOL = "openai-insecure-api-key."
AUDIO_CHUNK_BYTES = 64 * 1024  # PCM16 per Converse audio message
CLOSE_LIMIT, CLOSE_CAPACITY = 1008, 1013
_GONE = (WebSocketDisconnect, RuntimeError, OSError)


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
    """The ASGI WebSocket app of `/v1/realtime`; `stub` calls the gateway's own Omni port."""

    def __init__(
        self,
        stub: omni_pb2_grpc.OmniStub,
        options: RealtimeOptions,
        model: str,
        check_key: Callable[[tuple], str] | None = None,
    ) -> None:
        self.stub, self.options, self.model, self.check_key = stub, options, model, check_key
        self.slots = SessionSlots(options)
        self.metrics = RealtimeMetrics()

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
            with contextlib.suppress(*_GONE):
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


class RealtimeSession:
    """One socket's session (see the module's docstring)."""

    def __init__(self, endpoint: RealtimeEndpoint, ws: WebSocket, metadata: tuple) -> None:
        self.endpoint, self.ws, self.metadata = endpoint, ws, metadata
        self.options = endpoint.options
        self.id = rt.new_id("sess")
        self.conversation_id = rt.new_id("conv")
        self.config = rt.SessionConfig()
        self.detector: TurnDetector | None = TurnDetector(self.config.vad, rt.RATE)
        self.vad_origin = 0  # sample of the session's input where the detector's clock began
        self.buffer = bytearray()
        self.buffer_start = 0  # sample of the session's input where `buffer` begins
        self.speech_start: int | None = None  # sample where the speech being heard began (server VAD)
        self.pending: list[rt.UserItem] = []
        self.last_item: str | None = None
        self.next_item = ""  # the id the speech being heard will have as an item
        self.call: grpc.aio.StreamStreamCall | None = None
        self.call_fields: tuple | None = None
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
        except _GONE:
            return "client"
        finally:
            await self._close_call()

    async def _end(self, code: str, message: str) -> None:
        with contextlib.suppress(*_GONE):
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

    async def _handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "session.update":
            await self._session_update(event)
        elif kind == "input_audio_buffer.append":
            await self._append(event)
        elif kind == "input_audio_buffer.commit":
            await self._commit(event)
        elif kind == "input_audio_buffer.clear":
            self._clear_buffer()
            await self.send(rt.event("input_audio_buffer.cleared"))
        elif kind == "conversation.item.create":
            o = self.options
            await self._add_item(rt.user_item(event, o.max_turn_chars, o.max_buffer_bytes))
        elif kind == "conversation.item.truncate":
            await self._truncate(event)
        elif kind == "response.create":
            rt.response_options(event, self.config)
            if self.active is not None:
                raise rt.EventError(
                    f"a response ({self.active.id}) is still in progress (cancel it first)",
                    code="conversation_already_has_active_response",
                )
            if not self.pending:
                raise rt.EventError(
                    "no user input since the last response (add an item or commit the audio buffer)",
                    code="response_without_input",
                )
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
            raise rt.EventError(
                "session: instructions, voice, output_modalities and max_output_tokens are fixed once the "
                "conversation has begun (its first response)",
                code="session_locked",
                param="session",
            )
        if config.vad != self.config.vad:
            self.detector = TurnDetector(config.vad, rt.RATE) if config.vad is not None else None
            self.vad_origin = self.buffer_start + len(self.buffer) // 2  # its clock starts now
            self.speech_start = None
        self.config = config
        await self.send(rt.event("session.updated", session=self._session()))

    def _clear_buffer(self) -> None:
        self.buffer_start += len(self.buffer) // 2
        self.buffer.clear()
        self.speech_start = None
        if self.detector is not None:
            self.detector.reset()

    async def _append(self, event: dict[str, Any]) -> None:
        limit = self.options.max_buffer_bytes
        try:
            pcm = rt.audio_bytes(event.get("audio"), "audio", limit - len(self.buffer))
        except rt.EventError as err:
            if err.code == "input_audio_buffer_full":
                self._clear_buffer()  # the turn it belonged to is too long: it is dropped
                err.message += "; the buffer was cleared"
            raise
        self.buffer += pcm
        if self.detector is None:
            return
        for decision in await self.detector.feed(pcm):
            self.endpoint.metrics.vad(decision.started)
            sample = self.vad_origin + decision.ms * rt.RATE // 1000
            if decision.started:
                await self._speech_started(sample)
            elif self.speech_start is not None:
                await self._speech_stopped(sample * 1000 // rt.RATE)
        if self.speech_start is None:  # keep only the prefix padding before speech
            keep = self.config.vad.prefix_padding_ms * rt.RATE // 1000 * 2
            drop = max(0, len(self.buffer) - keep) // 2 * 2
            del self.buffer[:drop]
            self.buffer_start += drop // 2

    async def _speech_started(self, sample: int) -> None:
        pad = self.config.vad.prefix_padding_ms * rt.RATE // 1000
        start = max(self.buffer_start, sample - pad)
        del self.buffer[: (start - self.buffer_start) * 2]
        self.buffer_start, self.speech_start = start, sample
        item_id = rt.new_id("item")
        self.next_item = item_id
        await self.send(
            rt.event(
                "input_audio_buffer.speech_started", audio_start_ms=sample * 1000 // rt.RATE, item_id=item_id
            )
        )
        if self.active is not None and self.config.vad.interrupt_response:
            self.endpoint.metrics.barge_in()
            await self._cancel("turn_detected")

    async def _speech_stopped(self, end_ms: int) -> None:
        item_id = self.next_item
        await self.send(rt.event("input_audio_buffer.speech_stopped", audio_end_ms=end_ms, item_id=item_id))
        pcm = bytes(self.buffer)
        self._clear_buffer()
        await self._add_committed(rt.UserItem(item_id, pcm16=pcm))
        if self.config.vad.create_response:
            if self.active is not None:  # interrupt_response false: the newer turn supersedes it now
                await self._cancel("turn_detected")
            await self._respond("server_vad")

    async def _commit(self, event: dict[str, Any]) -> None:
        if len(self.buffer) < rt.RATE // 10 * 2:
            raise rt.EventError(
                f"the input audio buffer holds {len(self.buffer) * 500 // rt.RATE} ms, at least 100 ms are needed",
                code="input_audio_buffer_commit_empty",
            )
        pcm = bytes(self.buffer)
        self._clear_buffer()
        await self._add_committed(rt.UserItem(rt.new_id("item"), pcm16=pcm))

    async def _add_committed(self, item: rt.UserItem) -> None:
        await self.send(
            rt.event("input_audio_buffer.committed", previous_item_id=self.last_item, item_id=item.item_id)
        )
        await self._add_item(item)

    async def _add_item(self, item: rt.UserItem) -> None:
        part = (
            {"type": "input_text", "text": item.text}
            if item.text
            else {"type": "input_audio", "transcript": None}
        )
        body = {
            "id": item.item_id,
            "object": "realtime.item",
            "type": "message",
            "status": "completed",
            "role": "user",
            "content": [part],
        }
        await self.send(rt.event("conversation.item.created", previous_item_id=self.last_item, item=body))
        self.last_item = item.item_id
        self.pending.append(item)

    async def _truncate(self, event: dict[str, Any]) -> None:
        item_id, ms = event.get("item_id"), event.get("audio_end_ms")
        if item_id not in self.spoken:
            raise rt.EventError(f"item_id: no assistant audio item {item_id!r}", param="item_id")
        if event.get("content_index", 0) != 0:
            raise rt.EventError("content_index: the item has one content part (0)", param="content_index")
        sent_ms = self.spoken[item_id] * 1000 // rt.RATE
        if isinstance(ms, bool) or not isinstance(ms, int) or not 0 <= ms <= sent_ms:
            raise rt.EventError(
                f"audio_end_ms: expected 0 to {sent_ms} (the audio sent)", param="audio_end_ms"
            )
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
        if item.text:
            await self.call.write(omni_pb2.ConverseRequest(text=item.text))
        else:
            for at in range(0, len(item.pcm16), AUDIO_CHUNK_BYTES):
                chunk = omni_pb2.AudioChunk(
                    pcm16=item.pcm16[at : at + AUDIO_CHUNK_BYTES], sample_rate_hz=rt.RATE
                )
                await self.call.write(omni_pb2.ConverseRequest(audio=chunk))
            await self.call.write(omni_pb2.ConverseRequest(end_of_turn=True))
        self.turns_sent += 1

    async def _open_call(self) -> None:
        if self.call is not None:
            return
        c = self.config
        modalities = [omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if c.audio_out else [])
        config = omni_pb2.GenerateRequest(
            request_id=self.id,
            system_prompt=c.instructions,
            voice=c.voice,
            output_modalities=modalities,
            sampling=common_pb2.SamplingParams(max_tokens=c.max_output_tokens),
        )
        self.call = self.endpoint.stub.Converse(
            metadata=self.metadata, timeout=self.options.max_session_s + 30.0
        )
        self.call_fields, self.turns_sent = c.conversation_fields(), 0
        # Reading first: a call refused at once is reported by the reader like any failed call.
        self.reader = asyncio.create_task(self._read_call(self.call), name=f"realtime-{self.id}")
        await self.call.write(omni_pb2.ConverseRequest(config=config))

    async def _read_call(self, call: grpc.aio.StreamStreamCall) -> None:
        """The Converse call's events to the response they answer; its end (an error, or the call
        closed under us) to the client."""
        try:
            while (event := await call.read()) is not grpc.aio.EOF:
                response = self.active
                if response is not None and event.turn == response.turn:
                    await response.on_event(event)
            err = rt.EventError("the conversation ended", code="conversation_ended")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self.call is not call:
                return
            err = rt.EventError(exc.details() or exc.code().name, code=exc.code().name.lower())
            err.type = from_grpc(exc.code(), exc.details()).type  # as the HTTP front types it
        except _GONE:
            return  # the socket went: the session's end closes the call
        if self.call is call:
            self.call = None
            with contextlib.suppress(*_GONE):
                if self.active is not None:
                    await self.active.fail(err)
                await self.send(rt.error_event(err))

    async def _cancel(self, reason: str) -> None:
        response = self.active
        if response is None:
            return
        if self.call is not None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                await self.call.write(omni_pb2.ConverseRequest(cancel=True))
        await response.cancelled(reason)

    async def _close_call(self) -> None:
        call, self.call = self.call, None
        if self.active is not None:
            self.active.abandon()
        if call is not None:
            call.cancel()  # the Converse call ends: its stage streams with it
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)
