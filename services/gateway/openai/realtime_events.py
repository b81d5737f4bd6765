"""The OpenAI Realtime protocol's events (GA shape): client events checked field by field into what
the session needs, and the server events built as JSON objects.

A client event that is not JSON, not an object, of an unknown type or with a bad field raises
`EventError`: the session answers it with an `error` event naming the event and the field, and goes on.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from omnistage.services.gateway.openai.app import MAX_JSON_VALUES
from omnistage.services.gateway.openai.vad import VadSettings

RATE = 24000  # the protocol's audio/pcm rate, both ways
CLIENT_EVENTS = frozenset(
    {
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "input_audio_buffer.clear",
        "conversation.item.create",
        "conversation.item.truncate",
        "response.create",
        "response.cancel",
    }
)
# Session fields taken only when empty (the pipeline has no tools, tracing or prompt templates).
_EMPTY_ONLY = ("tools", "tracing", "prompt", "include")


class EventError(Exception):
    """A client event the session refuses: `error` event with `code`, `message` and `param`."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param
        self.event_id: str | None = None
        self.type = "invalid_request_error"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass(frozen=True)
class SessionConfig:
    """What `session.update` sets."""

    instructions: str = ""
    voice: str = ""  # empty: the talker's default voice
    audio_out: bool = True  # output_modalities ["audio"] (its transcript as text) or ["text"]
    vad: VadSettings | None = field(default_factory=VadSettings)  # None: turns are the client's
    max_output_tokens: int = 0  # 0: the thinker's default

    def conversation_fields(self) -> tuple:
        """What the Converse call is opened with (fixed once it is open)."""
        return (self.instructions, self.voice, self.audio_out, self.max_output_tokens)


def parse(raw: str | bytes) -> dict[str, Any]:
    """A client event as an object with a known `type` (EventError otherwise). Its JSON values are
    counted first, as the HTTP front counts a body's (the parser holds the GIL, even in a thread)."""
    data = raw.encode() if isinstance(raw, str) else raw
    values = data.count(b"{") + data.count(b"[") + data.count(b",")
    if values > MAX_JSON_VALUES:
        raise EventError(
            f"the event has {values} JSON objects, arrays and commas, at most {MAX_JSON_VALUES}",
            code="invalid_event",
        )
    try:
        event = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise EventError(f"the event is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(event, dict):
        raise EventError("the event must be a JSON object", code="invalid_event")
    kind = event.get("type")
    if kind not in CLIENT_EVENTS:
        err = EventError(f"unknown event type {kind!r}", code="invalid_event", param="type")
        err.event_id = _event_id(event)
        raise err
    return event


def _event_id(event: dict[str, Any]) -> str | None:
    value = event.get("event_id")
    return value if isinstance(value, str) else None


def with_event_id(err: EventError, event: dict[str, Any] | None) -> EventError:
    if event is not None and err.event_id is None:
        err.event_id = _event_id(event)
    return err


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise EventError(f"{where}: expected an object", param=where)
    return value


def _num(value: Any, where: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise EventError(f"{where}: expected a number from {low:g} to {high:g}, got {value!r}", param=where)
    return value


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise EventError(f"{where}: expected true or false", param=where)
    return value


def _pcm_format(value: Any, where: str) -> None:
    fmt = _obj(value, where)
    if fmt.get("type") != "audio/pcm" or fmt.get("rate", RATE) != RATE:
        raise EventError(
            f"{where}: only {{'type': 'audio/pcm', 'rate': {RATE}}} (PCM16 mono) is supported",
            code="unsupported_audio_format",
            param=where,
        )


def turn_detection(value: Any, old: VadSettings | None, where: str) -> VadSettings | None:
    if value is None:
        return None
    td = _obj(value, where)
    if td.get("type") != "server_vad":
        raise EventError(
            f"{where}.type: only 'server_vad' (or turn_detection null) is supported", param=f"{where}.type"
        )
    s = old or VadSettings()
    known = {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response"}
    known |= {"interrupt_response", "idle_timeout_ms"}
    for key in td.keys() - known:
        raise EventError(f"{where}.{key}: unknown field", param=f"{where}.{key}")
    if "threshold" in td:
        s = replace(s, threshold=_num(td["threshold"], f"{where}.threshold", 0.0, 1.0))
    if "prefix_padding_ms" in td:
        s = replace(
            s, prefix_padding_ms=int(_num(td["prefix_padding_ms"], f"{where}.prefix_padding_ms", 0, 5000))
        )
    if "silence_duration_ms" in td:
        ms = _num(td["silence_duration_ms"], f"{where}.silence_duration_ms", 32, 10_000)
        s = replace(s, silence_duration_ms=int(ms))
    if "create_response" in td:
        s = replace(s, create_response=_flag(td["create_response"], f"{where}.create_response"))
    if "interrupt_response" in td:
        s = replace(s, interrupt_response=_flag(td["interrupt_response"], f"{where}.interrupt_response"))
    if td.get("idle_timeout_ms") is not None:
        raise EventError(
            f"{where}.idle_timeout_ms: not supported (leave it null)", param=f"{where}.idle_timeout_ms"
        )
    return s


def _modalities(value: Any, where: str) -> bool:
    if value == ["audio"]:
        return True
    if value == ["text"]:
        return False
    raise EventError(f'{where}: expected ["audio"] or ["text"], got {value!r}', param=where)


def _max_tokens(value: Any, where: str) -> int:
    if value == "inf":
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise EventError(f"{where}: expected 1 to 4096 or 'inf', got {value!r}", param=where)
    return value


def _audio(value: Any, config: SessionConfig, where: str) -> SessionConfig:
    audio = _obj(value, where)
    for key in audio.keys() - {"input", "output"}:
        raise EventError(f"{where}.{key}: unknown field", param=f"{where}.{key}")
    inp = _obj(audio.get("input", {}), f"{where}.input")
    for key in inp.keys() - {"format", "turn_detection", "transcription", "noise_reduction"}:
        raise EventError(f"{where}.input.{key}: unknown field", param=f"{where}.input.{key}")
    for key in ("transcription", "noise_reduction"):
        if inp.get(key) is not None:
            raise EventError(
                f"{where}.input.{key}: not supported (leave it null)", param=f"{where}.input.{key}"
            )
    if "format" in inp:
        _pcm_format(inp["format"], f"{where}.input.format")
    if "turn_detection" in inp:
        config = replace(
            config, vad=turn_detection(inp["turn_detection"], config.vad, f"{where}.input.turn_detection")
        )
    out = _obj(audio.get("output", {}), f"{where}.output")
    for key in out.keys() - {"format", "voice", "speed"}:
        raise EventError(f"{where}.output.{key}: unknown field", param=f"{where}.output.{key}")
    if "format" in out:
        _pcm_format(out["format"], f"{where}.output.format")
    if out.get("speed", 1.0) != 1.0:
        raise EventError(f"{where}.output.speed: only 1.0 is supported", param=f"{where}.output.speed")
    if "voice" in out:
        voice = out["voice"]
        if not isinstance(voice, str) or len(voice) > 64:
            raise EventError(f"{where}.output.voice: expected a voice name", param=f"{where}.output.voice")
        config = replace(config, voice=voice)
    return config


def session_update(event: dict[str, Any], config: SessionConfig, max_chars: int) -> SessionConfig:
    """The session after a `session.update` (fields not sent keep their values)."""
    session = _obj(event.get("session"), "session")
    known = {"type", "model", "instructions", "output_modalities", "audio", "max_output_tokens"}
    known |= {"tool_choice", "truncation", *_EMPTY_ONLY}
    for key in session.keys() - known:
        raise EventError(f"session.{key}: unknown or unsupported field", param=f"session.{key}")
    if session.get("type", "realtime") != "realtime":
        raise EventError("session.type: only 'realtime' sessions are served", param="session.type")
    for key in _EMPTY_ONLY:
        if session.get(key):
            raise EventError(f"session.{key}: not supported here (leave it empty)", param=f"session.{key}")
    if "instructions" in session:
        text = session["instructions"]
        if not isinstance(text, str) or len(text) > max_chars:
            raise EventError(
                f"session.instructions: expected text of at most {max_chars} characters",
                param="session.instructions",
            )
        config = replace(config, instructions=text)
    if "output_modalities" in session:
        config = replace(
            config, audio_out=_modalities(session["output_modalities"], "session.output_modalities")
        )
    if "max_output_tokens" in session:
        config = replace(
            config, max_output_tokens=_max_tokens(session["max_output_tokens"], "session.max_output_tokens")
        )
    if "audio" in session:
        config = _audio(session["audio"], config, "session.audio")
    return config


def audio_bytes(
    value: Any, where: str, limit: int, *, held: int = 0, knob: str = "gateway.realtime_max_buffer_bytes"
) -> bytes:
    """Base64 PCM16 that keeps a turn within `limit` bytes (`held` of them taken already; `knob`: the
    key that sets the limit), its length checked before decoding, and after."""
    if not isinstance(value, str):
        raise EventError(f"{where}: expected base64 PCM16 text", param=where)
    full = EventError(
        f"{where}: one turn holds at most {limit} bytes of audio ({limit / (2 * RATE):g} s of PCM16 at "
        f"24 kHz; {knob})",
        code="input_audio_buffer_full",
        param=where,
    )
    limit = limit - held
    if len(value) > (max(limit, 0) + 2) // 3 * 4:
        raise full
    try:
        pcm = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise EventError(f"{where}: not valid base64", param=where) from None
    if len(pcm) > limit:
        raise full
    if len(pcm) % 2:
        raise EventError(f"{where}: {len(pcm)} bytes, PCM16 needs an even number", param=where)
    return pcm


@dataclass(frozen=True)
class UserItem:
    """A user message for the conversation: its text, or its audio (PCM16 at 24 kHz)."""

    item_id: str
    text: str = ""
    pcm16: bytes = b""


def user_item_object(item: UserItem) -> dict[str, Any]:
    """The server's view of a user item (`conversation.item.created`)."""
    part = (
        {"type": "input_text", "text": item.text}
        if item.text
        else {"type": "input_audio", "transcript": None}
    )
    return {
        "id": item.item_id,
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [part],
    }


def truncation(event: dict[str, Any], spoken: dict[str, int]) -> tuple[str, int]:
    """`conversation.item.truncate` checked against the audio sent of each item (`spoken`: samples):
    (item id, audio_end_ms)."""
    item_id, ms = event.get("item_id"), event.get("audio_end_ms")
    if item_id not in spoken:
        raise EventError(f"item_id: no assistant audio item {item_id!r}", param="item_id")
    if event.get("content_index", 0) != 0:
        raise EventError("content_index: the item has one content part (0)", param="content_index")
    sent_ms = spoken[item_id] * 1000 // RATE
    if isinstance(ms, bool) or not isinstance(ms, int) or not 0 <= ms <= sent_ms:
        raise EventError(f"audio_end_ms: expected 0 to {sent_ms} (the audio sent)", param="audio_end_ms")
    return item_id, ms


def user_item(
    event: dict[str, Any], max_chars: int, max_audio: int, knob: str = "gateway.realtime_max_buffer_bytes"
) -> UserItem:
    """`conversation.item.create` of a user message (input_text parts, or input_audio parts; their audio
    within `max_audio` bytes, which `knob` sets)."""
    item = _obj(event.get("item"), "item")
    if item.get("type", "message") != "message" or item.get("role") != "user":
        raise EventError(
            "item: only user messages (type 'message', role 'user') can be added", param="item.role"
        )
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise EventError("item.content: expected a non-empty list of parts", param="item.content")
    texts, audio = [], bytearray()
    for i, part in enumerate(content):
        where = f"item.content[{i}]"
        part = _obj(part, where)
        if part.get("type") == "input_text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif part.get("type") == "input_audio":
            audio += audio_bytes(part.get("audio"), f"{where}.audio", max_audio, held=len(audio), knob=knob)
        else:
            raise EventError(f"{where}: expected an input_text or input_audio part", param=f"{where}.type")
    if texts and audio:
        raise EventError(
            "item.content: text and audio in one message (send them as two)", param="item.content"
        )
    text = "".join(texts)
    if texts and not 1 <= len(text) <= max_chars:
        raise EventError(
            f"item.content: {len(text)} characters, a text message takes 1 to {max_chars}",
            param="item.content",
        )
    item_id = item.get("id") if isinstance(item.get("id"), str) and len(item["id"]) <= 64 else new_id("item")
    return UserItem(item_id, text=text, pcm16=bytes(audio))


def response_options(event: dict[str, Any], config: SessionConfig) -> None:
    """`response.create`'s `response` may only repeat the session's settings (one Converse call
    answers the whole session)."""
    response = event.get("response")
    if response is None:
        return
    response = _obj(response, "response")
    for key in response.keys() - {"conversation", "metadata", "output_modalities", "instructions"}:
        raise EventError(
            f"response.{key}: not supported per response (set it with session.update)",
            param=f"response.{key}",
        )
    if response.get("conversation", "auto") != "auto":
        raise EventError("response.conversation: only 'auto' is supported", param="response.conversation")
    if (
        "output_modalities" in response
        and _modalities(response["output_modalities"], "response.output_modalities") != config.audio_out
    ):
        raise EventError(
            "response.output_modalities: must be the session's (set it with session.update)",
            param="response.output_modalities",
        )
    if "instructions" in response and response["instructions"] != config.instructions:
        raise EventError(
            "response.instructions: must be the session's (set it with session.update)",
            param="response.instructions",
        )


# ---- server events


def error_event(err: EventError) -> dict[str, Any]:
    return {
        "type": "error",
        "event_id": new_id("event"),
        "error": {
            "type": err.type,
            "code": err.code,
            "message": err.message,
            "param": err.param,
            "event_id": err.event_id,
        },
    }


def session_object(session_id: str, model: str, config: SessionConfig) -> dict[str, Any]:
    vad = config.vad
    detection = None
    if vad is not None:
        detection = {
            "type": "server_vad",
            "threshold": vad.threshold,
            "prefix_padding_ms": vad.prefix_padding_ms,
            "silence_duration_ms": vad.silence_duration_ms,
            "create_response": vad.create_response,
            "interrupt_response": vad.interrupt_response,
            "idle_timeout_ms": None,
        }
    pcm = {"type": "audio/pcm", "rate": RATE}
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "output_modalities": ["audio" if config.audio_out else "text"],
        "instructions": config.instructions,
        "audio": {
            "input": {
                "format": pcm,
                "turn_detection": detection,
                "transcription": None,
                "noise_reduction": None,
            },
            "output": {"format": pcm, "voice": config.voice, "speed": 1.0},
        },
        "max_output_tokens": config.max_output_tokens or "inf",
        "tools": [],
        "tool_choice": "auto",
        "tracing": None,
    }


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}
