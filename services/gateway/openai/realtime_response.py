"""One Realtime response: the Converse answer of one turn as the protocol's response events (an
assistant message item with one audio or text part), and its end (`response.done` with the status,
the usage and the item as far as it was sent)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Protocol

from omnistage.services.gateway.openai import realtime_events as rt
from omnistage.services.gateway.openai.pcm import Pcm16Resampler
from omnistage.services.gateway.openai.realtime_limits import RealtimeMetrics
from omnistage.v1 import common_pb2, omni_pb2

_STATUS = {
    common_pb2.FINISH_REASON_STOP: ("completed", None),
    common_pb2.FINISH_REASON_STOP_STRING: ("completed", None),
    common_pb2.FINISH_REASON_LENGTH: ("incomplete", {"type": "incomplete", "reason": "max_output_tokens"}),
    common_pb2.FINISH_REASON_INTERRUPTED: ("cancelled", {"type": "cancelled", "reason": "turn_detected"}),
}


class _Endpoint(Protocol):
    metrics: RealtimeMetrics


class Conversation(Protocol):
    """What a response reads and updates of its session (realtime.RealtimeSession)."""

    conversation_id: str
    config: rt.SessionConfig
    endpoint: _Endpoint
    last_item: str | None
    active: Response | None
    spoken: dict[str, int]

    async def send(self, event: dict[str, Any], unless_done: Response | None = None) -> None: ...


class Response:
    """The response answering Converse turn `turn` of `session`."""

    def __init__(self, session: Conversation, turn: int, trigger: str) -> None:
        self.session, self.turn, self.trigger = session, turn, trigger
        self.id = rt.new_id("resp")
        self.item_id = rt.new_id("item")
        self.audio_out = session.config.audio_out
        self.text: list[str] = []
        self.tokens = 0
        self.samples = 0  # 24 kHz samples sent
        self._resampler: Pcm16Resampler | None = None
        self.done = False
        self.ended = asyncio.Event()  # response.done sent
        # Set by a cancel: the deltas still on their way are not sent, and the Converse call's Finish
        # of the turn (its usage) ends the response with this reason.
        self.cancel_reason = ""

    def _ids(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _part(self) -> dict[str, Any]:
        transcript = "".join(self.text)
        return (
            {"type": "output_audio", "transcript": transcript}
            if self.audio_out
            else {"type": "output_text", "text": transcript}
        )

    def _item(self, status: str) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "object": "realtime.item",
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [self._part()] if status != "in_progress" else [],
        }

    def _body(self, status: str, details: dict | None, usage: common_pb2.Usage | None) -> dict[str, Any]:
        prompt = usage.prompt_tokens if usage is not None else 0
        cached = usage.cached_prompt_tokens if usage is not None else 0  # the thinker's prefix cache
        out = usage.completion_tokens if usage is not None and usage.completion_tokens else self.tokens
        return {
            "object": "realtime.response",
            "id": self.id,
            "status": status,
            "status_details": details,
            "output": []
            if status == "in_progress"
            else [self._item("completed" if status == "completed" else "incomplete")],
            "conversation_id": self.session.conversation_id,
            "output_modalities": ["audio" if self.audio_out else "text"],
            "max_output_tokens": self.session.config.max_output_tokens or "inf",
            "audio": {
                "output": {
                    "format": {"type": "audio/pcm", "rate": rt.RATE},
                    "voice": self.session.config.voice,
                }
            },
            "usage": None
            if status == "in_progress"
            else {
                "total_tokens": prompt + out,
                "input_tokens": prompt,
                "output_tokens": out,
                "input_token_details": {"text_tokens": prompt, "audio_tokens": 0, "cached_tokens": cached},
                "output_token_details": {"text_tokens": out, "audio_tokens": 0},
            },
            "metadata": None,
        }

    async def begin(self) -> None:
        send = self.session.send
        self.session.last_item = self.item_id
        await send(rt.event("response.created", response=self._body("in_progress", None, None)))
        await send(
            rt.event(
                "response.output_item.added",
                response_id=self.id,
                output_index=0,
                item=self._item("in_progress"),
            )
        )
        part = (
            {"type": "output_audio", "transcript": ""}
            if self.audio_out
            else {"type": "output_text", "text": ""}
        )
        await send(rt.event("response.content_part.added", **self._ids(), part=part))

    async def on_event(self, event: omni_pb2.GenerateEvent) -> None:
        kind = event.WhichOneof("event")
        send = self.session.send
        if self.cancel_reason and kind != "finish":
            return
        if kind == "text" and event.text.text:
            self.text.append(event.text.text)
            self.tokens += len(event.text.token_ids)
            name = (
                "response.output_audio_transcript.delta" if self.audio_out else "response.output_text.delta"
            )
            await send(rt.event(name, **self._ids(), delta=event.text.text), unless_done=self)
        elif kind == "audio" and self.audio_out:
            chunk = event.audio
            if self._resampler is None:
                self._resampler = Pcm16Resampler(chunk.sample_rate_hz, rt.RATE)
            pcm = self._resampler.convert(chunk.pcm16) + (self._resampler.flush() if chunk.last else b"")
            if pcm:
                self.samples += len(pcm) // 2
                delta = base64.b64encode(pcm).decode()
                await send(
                    rt.event("response.output_audio.delta", **self._ids(), delta=delta), unless_done=self
                )
        elif kind == "finish":
            finish = event.finish
            status, details = _STATUS.get(finish.reason, ("failed", None))
            if status == "failed":
                details = {
                    "type": "failed",
                    "error": {"type": "server_error", "code": "answer_failed", "message": finish.message},
                }
            elif status == "cancelled":
                details = {"type": "cancelled", "reason": self.cancel_reason or "turn_detected"}
            await self._finish(status, details, finish.usage)

    async def cancelled(self, reason: str) -> None:
        await self._finish("cancelled", {"type": "cancelled", "reason": reason}, None)

    async def fail(self, err: rt.EventError) -> None:
        details = {"type": "failed", "error": {"type": err.type, "code": err.code, "message": err.message}}
        await self._finish("failed", details, None)

    def abandon(self) -> None:
        """The socket went: counted as cancelled, nothing sent."""
        if not self.done:
            self.done = True
            self.session.active = None
            self.session.endpoint.metrics.response_ended("cancelled")

    async def _finish(self, status: str, details: dict | None, usage: common_pb2.Usage | None) -> None:
        if self.done:
            return
        self.done = True
        try:
            await self._send_done(status, details, usage)
        finally:
            self.ended.set()

    async def _send_done(self, status: str, details: dict | None, usage: common_pb2.Usage | None) -> None:
        session = self.session
        if session.active is self:
            session.active = None
        session.endpoint.metrics.response_ended(status)
        if self.audio_out:
            session.spoken[self.item_id] = self.samples
            while len(session.spoken) > 64:  # the oldest items can no longer be truncated
                del session.spoken[next(iter(session.spoken))]
        send, ids, text = session.send, self._ids(), "".join(self.text)
        if self.audio_out:
            await send(rt.event("response.output_audio.done", **ids))
            await send(rt.event("response.output_audio_transcript.done", **ids, transcript=text))
        else:
            await send(rt.event("response.output_text.done", **ids, text=text))
        await send(rt.event("response.content_part.done", **ids, part=self._part()))
        item = self._item("completed" if status == "completed" else "incomplete")
        await send(rt.event("response.output_item.done", response_id=self.id, output_index=0, item=item))
        await send(rt.event("response.done", response=self._body(status, details, usage)))
