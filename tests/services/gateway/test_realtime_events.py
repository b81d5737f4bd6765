"""The Realtime protocol's client events checked field by field: what `session.update` sets, and the
field each refusal names."""

from __future__ import annotations

import base64

import pytest
from omnistage.services.gateway.openai import realtime_events as rt


def update(session: dict) -> rt.SessionConfig:
    return rt.session_update({"type": "session.update", "session": session}, rt.SessionConfig(), 1000)


def test_session_update_sets_what_it_names_and_keeps_the_rest():
    config = update(
        {
            "type": "realtime",
            "instructions": "Be brief.",
            "output_modalities": ["text"],
            "max_output_tokens": 64,
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": 24000},
                    "turn_detection": {"type": "server_vad", "threshold": 0.7, "silence_duration_ms": 800},
                },
                "output": {"voice": "DB30"},
            },
        }
    )
    assert (config.instructions, config.voice, config.audio_out, config.max_output_tokens) == (
        "Be brief.",
        "DB30",
        False,
        64,
    )
    assert (config.vad.threshold, config.vad.silence_duration_ms, config.vad.prefix_padding_ms) == (
        0.7,
        800,
        300,
    )
    assert update({"audio": {"input": {"turn_detection": None}}}).vad is None
    assert update({"max_output_tokens": "inf"}).max_output_tokens == 0


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"voices": "x"}, "session.voices"),
        ({"tools": [{"type": "function"}]}, "session.tools"),
        ({"output_modalities": ["audio", "text"]}, "session.output_modalities"),
        ({"instructions": "x" * 1001}, "session.instructions"),
        ({"max_output_tokens": 0}, "session.max_output_tokens"),
        (
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}},
            "session.audio.input.turn_detection.type",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}}},
            "session.audio.input.turn_detection.threshold",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": "yes"}}}},
            "session.audio.input.turn_detection.create_response",
        ),
        (
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            "session.audio.input.format",
        ),
        ({"audio": {"output": {"voice": 7}}}, "session.audio.output.voice"),
        (
            {"audio": {"input": {"transcription": {"model": "whisper-1"}}}},
            "session.audio.input.transcription",
        ),
    ],
)
def test_session_update_refusals_name_the_field(session, param):
    with pytest.raises(rt.EventError) as info:
        update(session)
    assert info.value.param == param and info.value.message.startswith(param)


def test_user_items_and_audio_are_checked():
    pcm = base64.b64encode(b"\x01\x00" * 10).decode()
    item = rt.user_item(
        {"item": {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": pcm}]}},
        100,
        100,
    )
    assert item.pcm16 == b"\x01\x00" * 10 and not item.text
    bad = [
        (
            {"type": "message", "role": "assistant", "content": [{"type": "input_text", "text": "x"}]},
            "item.role",
        ),
        ({"type": "message", "role": "user", "content": []}, "item.content"),
        (
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "x"}, {"type": "input_audio", "audio": pcm}],
            },
            "item.content",
        ),
        (
            {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "@@"}]},
            "item.content[0].audio",
        ),
    ]
    for body, param in bad:
        with pytest.raises(rt.EventError) as info:
            rt.user_item({"item": body}, 100, 100)
        assert info.value.param == param
    with pytest.raises(rt.EventError) as info:  # over the bound: refused before it is decoded
        rt.audio_bytes(base64.b64encode(b"\x00" * 102).decode(), "audio", 100)
    assert info.value.code == "input_audio_buffer_full"
    with pytest.raises(rt.EventError):
        rt.audio_bytes(base64.b64encode(b"\x00" * 3).decode(), "audio", 100)  # odd: not PCM16


def test_unknown_and_malformed_events_keep_their_event_id():
    with pytest.raises(rt.EventError) as info:
        rt.parse('{"type": "response.dance", "event_id": "e1"}')
    assert (info.value.event_id, info.value.param) == ("e1", "type")
    with pytest.raises(rt.EventError) as info:
        rt.parse("[1, 2]")
    assert info.value.code == "invalid_event"
