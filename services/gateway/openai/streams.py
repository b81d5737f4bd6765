"""Streamed answers as Server-Sent Events: `chat.completion.chunk`s and `text_completion` chunks of `n`
choices' Omni events, one driver for both (sse_body)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from omnistage.services.gateway.openai import answers
from omnistage.services.gateway.openai.errors import HttpError
from omnistage.services.gateway.openai.translate import ChatPlan
from omnistage.v1 import common_pb2, omni_pb2

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Chunks(Protocol):
    """The data objects of one stream: those sent first, then those of each event."""

    def start(self) -> list[dict[str, Any]]: ...
    def event(self, index: int, event: omni_pb2.GenerateEvent) -> list[dict[str, Any]]: ...


async def sse_body(
    events: AsyncIterator[tuple[int, omni_pb2.GenerateEvent]], chunks: Chunks
) -> AsyncIterator[bytes]:
    """The SSE body of the choices' (index, event)s: a Finish that failed, or an error of a call, is
    sent as `data: {"error": ...}` and ends the stream; `[DONE]` comes last. Leaving (the client went
    away) closes `events`: the stages stop now."""
    try:
        for obj in chunks.start():
            yield sse(obj)
        async for index, event in events:
            if event.WhichOneof("event") == "finish":
                err = answers.finish_error(event.finish)
                if err is not None:
                    yield sse(err.body())
                    break
            for obj in chunks.event(index, event):
                yield sse(obj)
    except HttpError as err:
        yield sse(err.body())
    finally:
        await events.aclose()
    yield DONE


class AudioDeltas:
    """delta.audio objects of a streamed answer: base64 data, the first wav one behind a streaming header."""

    def __init__(self, audio_id: str, audio_format: str) -> None:
        self.audio_id = audio_id
        self.format = audio_format
        self.started = False

    def delta(self, chunk_: omni_pb2.AudioChunk) -> dict[str, Any] | None:
        data = chunk_.pcm16
        if self.format == "wav" and not self.started:
            data = answers.streaming_wav_header(chunk_.sample_rate_hz) + data
        if not data:
            return None
        first = not self.started
        self.started = True
        out: dict[str, Any] = {"id": self.audio_id, "data": base64.b64encode(data).decode()}
        if first:
            out["sample_rate"] = chunk_.sample_rate_hz
        return out


class ChatChunks:
    """`chat.completion.chunk`s of the plan's choices. A forced tool call's text (sent whole at its
    finish), and an auto answer's `<tool_call>` block left open (sent as one text before its finish),
    are held: a call cut by max_tokens goes out as a call (answers.cut_answer), as OpenAI's."""

    def __init__(self, plan: ChatPlan, completion_id: str, created: int, model: str) -> None:
        self.plan = plan
        self.head = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        self.audio = AudioDeltas(f"audio-{completion_id}", plan.audio_format) if plan.audio_format else None
        self.calls = [0] * plan.n  # tool calls sent, per choice
        self.held = [""] * plan.n
        self.finishes: list[omni_pb2.Finish] = []

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None, logprobs=None) -> dict:
        return {
            **self.head,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }

    def start(self) -> list[dict[str, Any]]:
        return [self.chunk(i, {"role": "assistant", "content": ""}) for i in range(self.plan.n)]

    def event(self, index: int, event: omni_pb2.GenerateEvent) -> list[dict[str, Any]]:
        kind = event.WhichOneof("event")
        if kind == "text" and (event.text.text or event.text.logprobs):
            return self._text(index, event.text)
        if kind == "tool_call":
            self.calls[index] += 1
            return [
                self.chunk(index, {"tool_calls": [answers.tool_call(event.tool_call, self.calls[index] - 1)]})
            ]
        if kind == "audio" and self.audio is not None:
            delta = self.audio.delta(event.audio)
            return [] if delta is None else [self.chunk(index, {"audio": delta})]
        if kind == "finish":
            return self._finish(index, event.finish)
        return []

    def _text(self, index: int, delta: omni_pb2.TextDelta) -> list[dict[str, Any]]:
        text = delta.text
        if self.plan.forced_tools or (self.plan.auto_tools and answers.opened_call(text) is not None):
            self.held[index] += text
            text = ""
            if not delta.logprobs:
                return []
        return [
            self.chunk(index, {"content": text}, logprobs=answers.logprobs_object(self.plan, delta.logprobs))
        ]

    def _finish(self, index: int, finish: omni_pb2.Finish) -> list[dict[str, Any]]:
        out = []
        held, self.held[index] = self.held[index], ""
        cut = None
        if held and finish.reason == common_pb2.FINISH_REASON_LENGTH:
            held, cut = answers.cut_answer(held, self.calls[index], self.plan)
        if held:
            out.append(self.chunk(index, {"content": held}))
        if cut is not None:
            out.append(self.chunk(index, {"tool_calls": [answers.tool_call(cut, self.calls[index])]}))
        delta: dict[str, Any] = {}
        if self.audio is not None:
            delta["audio"] = {"id": self.audio.audio_id, **answers.audio_status(finish.audio)}
        out.append(self.chunk(index, delta, answers.finish_reason(finish)))
        self.finishes.append(finish)
        if len(self.finishes) == self.plan.n and self.plan.include_usage:
            out.append({**self.head, "choices": [], "usage": answers.usage(self.finishes)})
        return out


class CompletionChunks:
    """`text_completion` chunks of the plan's choices (legacy logprobs with each text)."""

    def __init__(self, plan: ChatPlan, cid: str, created: int, model: str) -> None:
        self.plan = plan
        self.head = (cid, created, model)
        self.offsets = [0] * plan.n  # characters sent, per choice (the logprobs' text_offset)
        self.finishes: list[omni_pb2.Finish] = []

    def start(self) -> list[dict[str, Any]]:
        return []

    def event(self, index: int, event: omni_pb2.GenerateEvent) -> list[dict[str, Any]]:
        kind = event.WhichOneof("event")
        if kind == "text" and (event.text.text or event.text.logprobs):
            lps = None
            if self.plan.logprobs:
                lps = answers.legacy_logprobs(
                    event.text.logprobs, self.plan.top_logprobs, self.offsets[index]
                )
            self.offsets[index] += len(event.text.text)
            return [
                answers.text_completion(*self.head, [answers.text_choice(index, event.text.text, lps, None)])
            ]
        if kind != "finish":
            return []
        reason = answers.finish_reason(event.finish)
        out = [answers.text_completion(*self.head, [answers.text_choice(index, "", None, reason)])]
        self.finishes.append(event.finish)
        if len(self.finishes) == self.plan.n and self.plan.include_usage:
            out.append(answers.text_completion(*self.head, [], answers.usage(self.finishes)))
        return out
