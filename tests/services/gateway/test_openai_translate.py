"""The OpenAI front's translation: bodies → Omni requests, events → responses, gRPC status → HTTP."""

from __future__ import annotations

import base64
import io
import json
import wave

import grpc
import pytest
from omnistage.services.gateway.openai import translate as tr
from omnistage.services.gateway.openai.app import BodyLimit
from omnistage.v1 import common_pb2, omni_pb2

PNG = b"\x89PNG\r\n\x1a\nfake"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_chat_body_maps_messages_parts_and_sampling():
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(PNG)}"}},
                    {"type": "input_audio", "input_audio": {"data": _b64(b"RIFFxx"), "format": "mp3"}},
                ],
            },
            {"role": "assistant", "content": "A cat."},
            {"role": "user", "content": "And now?"},
        ],
        "max_completion_tokens": 20,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": -1,
        "stop": "END",
        "presence_penalty": 0.5,
        "top_k": -1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    plan = tr.chat_request(body, request_id="r1")
    req = plan.request
    assert plan.stream and plan.include_usage and plan.audio_format == "" and plan.model == "m"
    assert req.request_id == "r1" and list(req.output_modalities) == [omni_pb2.MODALITY_TEXT]
    assert [m.role for m in req.messages] == [
        omni_pb2.ROLE_SYSTEM,
        omni_pb2.ROLE_USER,
        omni_pb2.ROLE_ASSISTANT,
        omni_pb2.ROLE_USER,
    ]
    parts = req.messages[1].parts
    assert parts[0].text == "What is this?"
    assert parts[1].image.data == PNG and parts[1].image.mime_type == "image/png"
    assert parts[2].audio.data == b"RIFFxx" and parts[2].audio.mime_type == "audio/mpeg"
    s = req.sampling
    assert (s.max_tokens, s.top_p, list(s.stop), s.top_k) == (20, pytest.approx(0.9), ["END"], 0)
    assert s.temperature == pytest.approx(0.5) and s.presence_penalty == pytest.approx(0.5)
    assert s.HasField("seed") and s.seed == 2**64 - 1


def test_chat_defaults_follow_openai():
    req = tr.chat_request({"messages": [{"role": "user", "content": "hi"}]}).request
    assert req.sampling.temperature == pytest.approx(1.0), "OpenAI's default temperature, not greedy"
    assert not req.sampling.HasField("seed") and req.sampling.max_tokens == 0


def test_audio_modality_and_voice():
    plan = tr.chat_request(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "DB30", "format": "pcm16"},
        }
    )
    assert list(plan.request.output_modalities) == [omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO]
    assert plan.request.voice == "DB30" and plan.audio_format == "pcm16"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_audio", "input_audio": {"data": "AA==", "format": "aac"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0].input_audio.format",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "file"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "x"}], "n": tr.MAX_CHOICES + 1}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "n": 2,
                "modalities": ["text", "audio"],
                "audio": {"voice": "DB30"},
            },
            "n",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 6},
            "max_completion_tokens",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "modalities": ["image"]}, "modalities"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "modalities": ["audio"],
                "audio": {"format": "mp3"},
            },
            "audio.format",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search", "function": {}}],
            },
            "tools[0].type",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "a"}},
            },
            "response_format.json_schema.schema",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
        ([1, 2], "body"),
    ],
)
def test_bad_chat_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(tr.HttpError) as info:
        tr.chat_request(body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["message"].startswith(param)


def test_speech_and_image_bodies():
    plan = tr.speech_request(
        {"input": "Hello.", "voice": "DB30", "response_format": "pcm", "stream_format": "sse"}
    )
    req = plan.request
    assert plan.sse and plan.response_format == "pcm"
    assert list(req.output_modalities) == [omni_pb2.MODALITY_AUDIO] and req.voice == "DB30"
    assert req.messages[0].parts[0].text == "Hello." and req.system_prompt == tr.SPEECH_SYSTEM_PROMPT
    for bad, param in (
        ({"input": ""}, "input"),
        ({"input": "x", "response_format": "mp3"}, "response_format"),
        ({"input": "x", "speed": 2.0}, "speed"),
        ({"input": "x" * 10}, "input"),
    ):
        with pytest.raises(tr.HttpError) as info:
            tr.speech_request(bad, max_chars=5)
        assert info.value.param == param
    img = tr.image_request(
        {"prompt": "a cat", "size": "512x256", "num_inference_steps": 4, "seed": 9, "guidance_scale": 3.5}
    )
    assert list(img.output_modalities) == [omni_pb2.MODALITY_IMAGE]
    o = img.image
    assert (o.width, o.height, o.steps, o.seed, o.guidance_scale) == (512, 256, 4, 9, 3.5)
    for bad, param in (
        ({"prompt": "x", "size": "big"}, "size"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "response_format": "url"}, "response_format"),
        ({}, "prompt"),
    ):
        with pytest.raises(tr.HttpError) as info:
            tr.image_request(bad)
        assert info.value.param == param


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
    err = tr.from_grpc(code, "detail")
    assert err.status == status and err.message == "detail" and err.code == code.name.lower()


def test_retry_after_from_pushback_and_message_size_is_413():
    err = tr.from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("grpc-retry-pushback-ms", "2500"),))
    assert err.status == 429 and err.headers == {"Retry-After": "3", "retry-after-ms": "2500"}
    err = tr.from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("grpc-retry-pushback-ms", b"200"),))
    assert err.headers["Retry-After"] == "1" and err.headers["retry-after-ms"] == "200"
    big = tr.from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)")
    assert big.status == 413


def _events(*events: omni_pb2.GenerateEvent) -> tr.Result:
    c = tr.Result()
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
    body = tr.chat_completion(c, completion_id="chatcmpl-x", created=100, model="m", audio_format="wav")
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
    assert tr.finish_error(omni_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP)) is None
    assert (
        tr.finish_error(omni_pb2.Finish(reason=common_pb2.FINISH_REASON_ERROR, message="boom")).status == 500
    )
    assert tr.finish_error(omni_pb2.Finish(reason=common_pb2.FINISH_REASON_ABORT)).status == 503
    deltas = tr.AudioDeltas("a1", "wav")
    first = deltas.delta(omni_pb2.AudioChunk(pcm16=b"\x01\x00", sample_rate_hz=8000))
    raw = base64.b64decode(first["data"])
    assert raw[:4] == b"RIFF" and raw[44:] == b"\x01\x00" and first["sample_rate"] == 8000
    assert base64.b64decode(deltas.delta(omni_pb2.AudioChunk(pcm16=b"\x02\x00"))["data"]) == b"\x02\x00"
    assert deltas.delta(omni_pb2.AudioChunk(pcm16=b"", last=True)) is None
    busy = tr.speech_error(
        omni_pb2.AudioStatus(
            outcome=omni_pb2.AUDIO_OUTCOME_NONE, code="RESOURCE_EXHAUSTED", retry_after_ms=1500
        )
    )
    assert busy.status == 429 and busy.headers["Retry-After"] == "2"


def test_body_limit_answers_413():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def echo(request):
        return JSONResponse({"n": len(await request.body())})

    app = Starlette(
        routes=[Route("/", echo, methods=["POST"])],
        exception_handlers={tr.HttpError: lambda r, e: JSONResponse(e.body(), status_code=e.status)},
    )
    client = TestClient(BodyLimit(app, 100))
    assert client.post("/", content=b"x" * 100).json() == {"n": 100}
    r = client.post("/", content=b"x" * 101)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield b"x" * 60
        yield b"x" * 60

    assert client.post("/", content=chunks()).status_code == 413  # no Content-Length: counted as it arrives


@pytest.mark.parametrize(
    ("extra", "wanted", "top"),
    [({"logprobs": True}, 1, 0), ({"logprobs": True, "top_logprobs": 5}, 5, 5), ({}, 0, 0)],
)
def test_logprobs_ask_the_thinker_for_the_top_list_they_show(extra, wanted, top):
    plan = tr.chat_request({"messages": [{"role": "user", "content": "x"}], "n": 3, **extra})
    assert plan.request.sampling.logprobs == wanted and plan.top_logprobs == top
    assert plan.logprobs == bool(wanted) and plan.n == 3


def test_response_formats_become_the_thinkers_constraint():
    def constraint(rf):
        return tr.chat_request({"messages": [{"role": "user", "content": "x"}], "response_format": rf})

    assert not constraint({"type": "text"}).request.sampling.HasField("constraint")
    assert constraint({"type": "json_object"}).request.sampling.constraint.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    plan = constraint({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert json.loads(plan.request.sampling.constraint.json_schema) == schema


def test_tools_tool_choice_and_tool_turns_map_to_omni():
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [weather],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
    }
    request = tr.chat_request(body).request
    assert request.tool_choice == omni_pb2.TOOL_CHOICE_FUNCTION and request.tool_choice_function == "weather"
    (tool,) = request.tools
    assert (tool.name, tool.description) == ("weather", "Weather of a city.")
    assert json.loads(tool.parameters_json) == weather["function"]["parameters"]
    assistant, result = request.messages[1], request.messages[2]
    assert list(assistant.parts) == [] and assistant.tool_calls[0].arguments_json == '{"city": "Paris"}'
    assert (
        result.role == omni_pb2.ROLE_TOOL
        and result.tool_call_id == "call_1"
        and result.parts[0].text == "sunny"
    )
    for choice, want in (
        ("auto", omni_pb2.TOOL_CHOICE_AUTO),
        ("none", omni_pb2.TOOL_CHOICE_NONE),
        ("required", omni_pb2.TOOL_CHOICE_REQUIRED),
    ):
        assert tr.chat_request({**body, "tool_choice": choice}).request.tool_choice == want
