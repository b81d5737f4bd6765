"""The OpenAI front's answers: finished Omni answers and streamed events → OpenAI's objects, gRPC
status → HTTP errors."""

from __future__ import annotations

import base64
import io
import wave

import grpc
import pytest
from omnistage.common.client import Result
from omnistage.services.gateway.openai import answers
from omnistage.services.gateway.openai import translate as tr
from omnistage.services.gateway.openai.errors import from_grpc
from omnistage.services.gateway.openai.streams import AudioDeltas
from omnistage.v1 import common_pb2, omni_pb2


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
    ],
)
def test_grpc_status_to_http(code, status):
    err = from_grpc(code, "detail")
    assert err.status == status and err.message == "detail" and err.code == code.name.lower()


def test_retry_after_from_pushback_and_message_size_is_413():
    err = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("grpc-retry-pushback-ms", "2500"),))
    assert err.status == 429 and err.headers == {"Retry-After": "3", "retry-after-ms": "2500"}
    err = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("grpc-retry-pushback-ms", b"200"),))
    assert err.headers["Retry-After"] == "1" and err.headers["retry-after-ms"] == "200"
    big = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)")
    assert big.status == 413


def _events(*events: omni_pb2.GenerateEvent) -> Result:
    c = Result()
    for e in events:
        c.add(e)
    return c


def test_non_streaming_completion_with_audio():
    finish = omni_pb2.Finish(
        reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=2, cached_prompt_tokens=3),
        audio=omni_pb2.AudioStatus(
            outcome=omni_pb2.AUDIO_OUTCOME_COMPLETE, voice="DB30", sample_rate_hz=16000, samples=3
        ),
    )
    c = _events(
        omni_pb2.GenerateEvent(text=omni_pb2.TextDelta(text="Hi ")),
        omni_pb2.GenerateEvent(audio=omni_pb2.AudioChunk(pcm16=b"\x01\x00\x02\x00", sample_rate_hz=16000)),
        omni_pb2.GenerateEvent(text=omni_pb2.TextDelta(text="there")),
        omni_pb2.GenerateEvent(audio=omni_pb2.AudioChunk(pcm16=b"\x03\x00", sample_rate_hz=16000, last=True)),
        omni_pb2.GenerateEvent(finish=finish),
    )
    plan = tr.ChatPlan(omni_pb2.GenerateRequest(), stream=False, include_usage=False, audio_format="wav")
    body = answers.chat_completion([c], plan, completion_id="chatcmpl-x", created=100, model="m")
    msg = body["choices"][0]["message"]
    assert msg["content"] == "Hi there" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    audio = msg["audio"]
    assert (
        audio["transcript"] == "Hi there" and audio["outcome"] == "complete" and audio["sample_rate"] == 16000
    )
    with wave.open(io.BytesIO(base64.b64decode(audio["data"]))) as w:
        assert w.getframerate() == 16000 and w.readframes(10) == b"\x01\x00\x02\x00\x03\x00"


def test_finish_errors_and_streamed_audio_deltas():
    assert answers.finish_error(omni_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP)) is None
    assert (
        answers.finish_error(omni_pb2.Finish(reason=common_pb2.FINISH_REASON_ERROR, message="boom")).status
        == 500
    )
    assert answers.finish_error(omni_pb2.Finish(reason=common_pb2.FINISH_REASON_ABORT)).status == 503
    deltas = AudioDeltas("a1", "wav")
    first = deltas.delta(omni_pb2.AudioChunk(pcm16=b"\x01\x00", sample_rate_hz=8000))
    raw = base64.b64decode(first["data"])
    assert raw[:4] == b"RIFF" and raw[44:] == b"\x01\x00" and first["sample_rate"] == 8000
    assert base64.b64decode(deltas.delta(omni_pb2.AudioChunk(pcm16=b"\x02\x00"))["data"]) == b"\x02\x00"
    assert deltas.delta(omni_pb2.AudioChunk(pcm16=b"", last=True)) is None
    busy = answers.speech_error(
        omni_pb2.AudioStatus(
            outcome=omni_pb2.AUDIO_OUTCOME_NONE, code="RESOURCE_EXHAUSTED", retry_after_ms=1500
        )
    )
    assert busy.status == 429 and busy.headers["Retry-After"] == "2"
