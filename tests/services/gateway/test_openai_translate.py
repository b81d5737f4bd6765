"""The OpenAI front's translation of request bodies into Omni requests (chat, speech, images)."""

from __future__ import annotations

import base64
import json

import pytest
from omnistage.services.gateway.openai import media_requests
from omnistage.services.gateway.openai import translate as tr
from omnistage.services.gateway.openai.app import BodyLimit
from omnistage.services.gateway.openai.chat_body import MAX_CHOICES
from omnistage.services.gateway.openai.errors import HttpError
from omnistage.v1 import omni_pb2

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


@pytest.mark.parametrize("skip", [None, True, False])
def test_skip_special_tokens_maps_to_keeping_them_in_the_text(skip):
    extra = {} if skip is None else {"skip_special_tokens": skip}
    chat = tr.chat_request({"messages": [{"role": "user", "content": "hi"}], **extra})
    completion = tr.completion_request({"prompt": "hi", **extra})
    for plan in (chat, completion):
        assert plan.request.sampling.keep_special_tokens is (skip is False), "vLLM's default: skipped"


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
        ({"messages": [{"role": "user", "content": "x"}], "n": MAX_CHOICES + 1}, "n"),
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
        ({"messages": [{"role": "user", "content": "x"}], "modalities": ["image"]}, "modalities[0]"),
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
        ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop[0]"),
        ([1, 2], "body"),
    ],
)
def test_bad_chat_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(HttpError) as info:
        tr.chat_request(body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["message"].startswith(param)


def test_speech_and_image_bodies():
    plan = media_requests.speech_request(
        {"input": "Hello.", "voice": "DB30", "response_format": "pcm", "stream_format": "sse"}
    )
    req = plan.request
    assert plan.sse and plan.response_format == "pcm"
    assert list(req.output_modalities) == [omni_pb2.MODALITY_AUDIO] and req.voice == "DB30"
    assert (
        req.messages[0].parts[0].text == "Hello." and req.system_prompt == media_requests.SPEECH_SYSTEM_PROMPT
    )
    for bad, param in (
        ({"input": ""}, "input"),
        ({"input": "x", "response_format": "mp3"}, "response_format"),
        ({"input": "x", "speed": 2.0}, "speed"),
        ({"input": "x" * 10}, "input"),
    ):
        with pytest.raises(HttpError) as info:
            media_requests.speech_request(bad, max_chars=5)
        assert info.value.param == param
    img = media_requests.image_request(
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
        with pytest.raises(HttpError) as info:
            media_requests.image_request(bad)
        assert info.value.param == param


def test_body_limit_answers_413():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def echo(request):
        return JSONResponse({"n": len(await request.body())})

    app = Starlette(
        routes=[Route("/", echo, methods=["POST"])],
        exception_handlers={HttpError: lambda r, e: JSONResponse(e.body(), status_code=e.status)},
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
