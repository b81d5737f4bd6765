"""The Realtime endpoint through the official `openai` client (`client.realtime.connect`): small
helpers the end-to-end tests share."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import openai

from tests.services.gateway.realtime_audio import utterance

MODEL = "ming-flash-omni-2.0"
EVENT_DEADLINE_S = 120.0
CHUNK_BYTES = 4800  # 100 ms of PCM16 at 24 kHz, as a microphone sends it


def client(base: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def as_dict(event: Any) -> dict[str, Any]:
    return event.model_dump() if hasattr(event, "model_dump") else dict(event)


async def next_event(conn, log: list[dict[str, Any]]) -> dict[str, Any]:
    event = as_dict(await asyncio.wait_for(conn.recv(), EVENT_DEADLINE_S))
    log.append(event)
    return event


async def until(conn, log: list[dict[str, Any]], kind: str, **match: Any) -> dict[str, Any]:
    """Events until one of `kind` (whose fields match `match`); all of them kept in `log`."""
    while True:
        event = await next_event(conn, log)
        if event["type"] == kind and all(event.get(k) == v for k, v in match.items()):
            return event


async def speak(conn, pcm: bytes | None = None) -> None:
    """A microphone: `pcm` (an utterance by default) in 100 ms appends."""
    pcm = utterance() if pcm is None else pcm
    for at in range(0, len(pcm), CHUNK_BYTES):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[at : at + CHUNK_BYTES]).decode())


def types(log: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in log]


def audio_of(log: list[dict[str, Any]], response_id: str) -> bytes:
    return b"".join(
        base64.b64decode(e["delta"])
        for e in log
        if e["type"] == "response.output_audio.delta" and e["response_id"] == response_id
    )
