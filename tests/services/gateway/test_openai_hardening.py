"""What one client's body must not do to the OpenAI front, and the OpenAI habits it keeps (issue 43),
against a fake Omni servicer (as test_openai_app.py): lone surrogates and unknown nested fields are 400s
naming the field, large bodies are parsed in a bounded pool while the event loop serves, a forced tool
call cut by max_tokens stays a call, OpenAI voice names are taken, Omni refusals name the body's field."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import pytest
from omnistage.services.gateway.openai import text_routes
from omnistage.services.gateway.openai.body import INLINE_PARSE_BYTES, PARSE_THREADS
from omnistage.v1 import common_pb2, omni_pb2

from tests.services.gateway.test_openai_app import FakeOmni, asgi, chat_body, finish, run, text

USER = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "time_now"}}


def _post(path: str, body: dict | list, omni: FakeOmni | None = None, **options):
    omni = omni or FakeOmni([text("Hi"), finish()])

    async def scenario(app, omni):
        return await asgi(app, "POST", path, json.dumps(body).encode())

    status, headers, reply = run(scenario, omni, **options)
    return status, headers, reply, omni


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi \ud800"}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
            "messages[0].content[0].text",
        ),
        ("/v1/chat/completions", {"messages": USER, "stop": ["\ud800"]}, "stop[0]"),
        ("/v1/chat/completions", {"messages": USER, "model": "m\ud800"}, "model"),
        (
            "/v1/chat/completions",
            {
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}],
            },
            "tools[0].function.description",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"\ud800": {}}}}],
            },
            "tools[0].function.parameters",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "modalities": ["text", "audio"], "audio": {"voice": "\ud800"}},
            "audio.voice",
        ),
        ("/v1/completions", {"prompt": "hi \ud800"}, "prompt"),
        ("/v1/audio/speech", {"input": "hi \ud800"}, "input"),
        ("/v1/audio/speech", {"input": "hi", "instructions": "\ud800"}, "instructions"),
        ("/v1/images/generations", {"prompt": "a cat \ud800"}, "prompt"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(path, body, param):
    status, _, reply, omni = _post(path, body)
    error = json.loads(reply)["error"]
    assert (status, error["param"]) == (400, param), reply
    assert "not valid Unicode" in error["message"] and omni.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"messages": USER, "stream": True, "stream_options": {"include_usag": True}},
            "stream_options.include_usag",
        ),
        ({"messages": [{"role": "user", "contnet": "Hi"}]}, "messages[0].contnet"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "txet": "x"}]}]},
            "messages[0].content[0].txet",
        ),
        (
            {
                "messages": USER,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "shcema": {}}},
            },
            "response_format.json_schema.shcema",
        ),
        (
            {"messages": USER, "response_format": {"type": "json_object", "strict": True}},
            "response_format.strict",
        ),
        (
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "paramters": {}}}]},
            "tools[0].function.paramters",
        ),
        ({"messages": USER, "tools": [{**TIME, "strict": True}]}, "tools[0].strict"),
        (
            {"messages": USER, "tool_choice": {"type": "function", "function": {"nmae": "f"}}},
            "tool_choice.function.nmae",
        ),
    ],
)
def test_unknown_fields_below_the_top_level_are_refused_naming_their_path(body, param):
    status, _, reply, omni = _post("/v1/chat/completions", body)
    error = json.loads(reply)["error"]
    assert (status, error["param"], error["code"]) == (400, param, "unknown_parameter"), reply
    assert error["message"] == f"Unrecognized request argument supplied: {param}"
    assert omni.requests == []


def test_the_switch_drops_unknown_fields_at_every_level():
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}], "x": 1}
        ],
        "stream_options": {"include_usag": True},
        "foo": 1,
    }
    status, _, reply, omni = _post("/v1/chat/completions", body, allow_unknown_fields=True)
    assert status == 200, reply
    assert omni.requests[0].messages[0].parts[0].text == "Hi"


def _finish(reason: int) -> omni_pb2.GenerateEvent:
    usage = common_pb2.Usage(prompt_tokens=9, completion_tokens=12)
    return omni_pb2.GenerateEvent(finish=omni_pb2.Finish(reason=reason, usage=usage))


def _cut(answer: str) -> list[omni_pb2.GenerateEvent]:
    """A forced call's answer as the gateway sends it when max_tokens cuts it: the text whole, then LENGTH."""
    return [text(answer), _finish(common_pb2.FINISH_REASON_LENGTH)]


@pytest.mark.parametrize(
    ("tools", "choice", "answer", "name", "arguments"),
    [
        ([WEATHER], "required", '{"name": "weat', "weather", ""),
        (
            [WEATHER, TIME],
            "required",
            '{"name": "weather", "arguments": {"city": "Par',
            "weather",
            '{"city": "Par',
        ),
        ([WEATHER, TIME], {"type": "function", "function": {"name": "time_now"}}, '{"na', "time_now", ""),
    ],
    ids=["name-cut", "arguments-cut", "named-function"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_cut_by_max_tokens_stays_a_call(tools, choice, answer, name, arguments, stream):
    body = {"messages": USER, "tools": tools, "tool_choice": choice, "max_tokens": 12, "stream": stream}
    status, _, reply, _ = _post("/v1/chat/completions", body, FakeOmni(_cut(answer)))
    assert status == 200, reply
    if not stream:
        (choice_,) = json.loads(reply)["choices"]
        message, finish_reason = choice_["message"], choice_["finish_reason"]
        (call,) = message["tool_calls"]
        assert message["content"] is None
    else:
        chunks = [json.loads(line[6:]) for line in reply.decode().splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas) == ""
        (call,) = [tc for d in deltas for tc in d.get("tool_calls", ())]
        assert call["index"] == 0
        finish_reason = chunks[-1]["choices"][0]["finish_reason"]
    assert finish_reason == "length"
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": name, "arguments": arguments}


def test_an_auto_answer_cut_by_max_tokens_stays_text():
    body = {"messages": USER, "tools": [WEATHER], "max_tokens": 12}
    status, _, reply, _ = _post("/v1/chat/completions", body, FakeOmni(_cut('{"name": "weat')))
    message = json.loads(reply)["choices"][0]["message"]
    assert status == 200 and message["content"] == '{"name": "weat' and "tool_calls" not in message


def _answer(reply: bytes, stream: bool) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish_reason) of a one-choice chat answer, whole or streamed."""
    if not stream:
        (choice,) = json.loads(reply)["choices"]
        message = choice["message"]
        return message["content"] or "", message.get("tool_calls", []), choice["finish_reason"]
    chunks = [json.loads(line[6:]) for line in reply.decode().splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    return (
        content,
        [tc for d in deltas for tc in d.get("tool_calls", ())],
        chunks[-1]["choices"][0]["finish_reason"],
    )


@pytest.mark.parametrize("stream", [False, True])
def test_an_auto_tool_call_cut_by_max_tokens_stays_a_call(stream):
    body = {"messages": USER, "tools": [WEATHER, TIME], "max_tokens": 12, "stream": stream}
    call = omni_pb2.ToolCall(id="call_1", name="time_now", arguments_json="{}")
    events = [text("Let me see. "), omni_pb2.GenerateEvent(tool_call=call)]
    events += _cut('<tool_call>\n{"name": "weather", "arguments": {"ci')  # the scanner's open block
    status, _, reply, _ = _post("/v1/chat/completions", body, FakeOmni(events))
    assert status == 200, reply
    content, calls, finish_reason = _answer(reply, stream)
    assert content == "Let me see. " and finish_reason == "length"
    assert [c["function"] for c in calls] == [
        {"name": "time_now", "arguments": "{}"},
        {"name": "weather", "arguments": '{"ci'},
    ]
    if stream:
        assert [c["index"] for c in calls] == [0, 1]


@pytest.mark.parametrize("stream", [False, True])
def test_an_open_block_that_is_no_call_or_not_cut_stays_text(stream):
    body = {"messages": USER, "tools": [WEATHER], "max_tokens": 12, "stream": stream}
    for answer, reason in (
        ("<tool_call>\nnot a call", common_pb2.FINISH_REASON_LENGTH),
        ('<tool_call>\n{"name": "wea', common_pb2.FINISH_REASON_STOP),
    ):
        events = [text("Hm. "), text(answer), _finish(reason)]
        status, _, reply, _ = _post("/v1/chat/completions", body, FakeOmni(events))
        content, calls, _ = _answer(reply, stream)
        assert status == 200 and content == "Hm. " + answer and calls == []


@pytest.mark.parametrize(
    ("path", "body", "voice"),
    [
        (
            "/v1/chat/completions",
            {"messages": USER, "modalities": ["text", "audio"], "audio": {"voice": "alloy"}},
            "",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "modalities": ["text", "audio"], "audio": {"voice": "DB30"}},
            "DB30",
        ),
        ("/v1/audio/speech", {"input": "Hi", "voice": "shimmer"}, ""),
        ("/v1/audio/speech", {"input": "Hi", "voice": {"id": "marin"}}, ""),
        ("/v1/audio/speech", {"input": "Hi", "voice": "lingguang"}, "lingguang"),
    ],
)
def test_openai_voice_names_speak_the_default_preset(path, body, voice):
    audio = omni_pb2.GenerateEvent(audio=omni_pb2.AudioChunk(pcm16=b"\x01\x00", sample_rate_hz=16000))
    status, _, reply, omni = _post(path, body, FakeOmni([text("Hi"), audio, finish()]))
    assert status == 200, reply
    assert omni.requests[0].voice == voice


class RefusingOmni(FakeOmni):
    """Refuses every call with INVALID_ARGUMENT `details`, as the gateway does."""

    def __init__(self, details: str) -> None:
        super().__init__([])
        self.details = details

    async def Generate(self, request, context):
        self.requests.append(request)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.details)
        yield  # pragma: no cover (an async generator, as the real servicer)


@pytest.mark.parametrize(
    ("path", "body", "details", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": USER, "max_tokens": 5000},
            "sampling.max_tokens: 5000 + a prompt",
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "max_completion_tokens": 5000},
            "thinker: sampling.max_tokens: 5000 exceeds max_model_len 1024",
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "modalities": ["text", "audio"], "audio": {"voice": "nope"}},
            "voice: unknown voice 'nope' (have: DB30, lingguang)",
            "audio.voice",
        ),
        ("/v1/audio/speech", {"input": "Hi", "voice": "nope"}, "voice: unknown voice 'nope'", "voice"),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].name: 1 to 64 of a-z, A-Z, 0-9, _ and -; got 'a b'",
            "tools[0].function.name",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER},
            "thinker: prompt: 2000 tokens leave no room to generate (max_model_len 1024)",
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": ""}]},
            "messages[1].parts[0].text: empty text (give it text or leave the part out)",
            "messages[1].content",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": ""}],
                    }
                ]
            },
            "messages[0].parts[1].text: empty text",
            "messages[0].content[1].text",
        ),
        ("/v1/completions", {"prompt": "Hi"}, "thinker: prompt: 2000 tokens leave no room", "prompt"),
        (
            "/v1/completions",
            {"prompt": [5, 6]},
            "thinker: chat.pieces[0].client_tokens: 5 is a special token",
            "prompt",
        ),
        (
            "/v1/images/generations",
            {"prompt": "a cat", "size": "100x100"},
            "image.width: 100 is not a multiple of 16",
            "size",
        ),
        ("/v1/chat/completions", {"messages": USER}, "something without a field", None),
    ],
)
def test_refusals_of_the_omni_call_name_the_body_field(path, body, details, param):
    status, _, reply, _ = _post(path, body, RefusingOmni(details))
    error = json.loads(reply)["error"]
    assert (status, error["message"], error["param"]) == (400, details, param)


def test_completion_streams_are_not_cached_or_buffered():
    status, headers, _, _ = _post("/v1/completions", {"prompt": "Once", "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"


def _large_completion() -> bytes:
    return json.dumps({"prompt": list(range(INLINE_PARSE_BYTES // 4))}).encode()


class Parses:
    """The completions translation held until `release`: how many ran at once at most."""

    def __init__(self) -> None:
        self.real = text_routes.completion_request
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def __call__(self, data, **kwargs):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.entered.release()
        self.release.wait(30)
        with self.lock:
            self.running -= 1
        return self.real(data, **kwargs)


def test_large_bodies_are_parsed_one_at_once_while_the_event_loop_serves(monkeypatch):
    parses = Parses()
    monkeypatch.setattr(text_routes, "completion_request", parses)

    async def scenario(app, omni):
        big = [
            asyncio.ensure_future(asgi(app, "POST", "/v1/completions", _large_completion())) for _ in range(6)
        ]
        await asyncio.to_thread(parses.entered.acquire, timeout=30)
        health = await asgi(app, "GET", "/health")  # served while a parse holds the pool
        canary = await asgi(app, "POST", "/v1/chat/completions", chat_body())  # small: parsed at once
        parses.release.set()
        return health, canary, await asyncio.gather(*big)

    health, canary, big = run(scenario, FakeOmni([text("Hi"), finish()]))
    assert health[0] == 200 and canary[0] == 200
    assert [status for status, _, _ in big] == [200] * 6
    assert parses.most == PARSE_THREADS == 1, "large bodies are parsed in a pool of one, not a thread each"


@pytest.mark.parametrize("bound", ["max_large_body_bytes", "max_large_body_values"])
def test_large_bodies_beyond_the_bound_in_flight_are_429_with_retry_after(monkeypatch, bound):
    parses = Parses()
    monkeypatch.setattr(text_routes, "completion_request", parses)
    body = _large_completion()
    size = len(body) if bound == "max_large_body_bytes" else body.count(b",") + 2

    async def scenario(app, omni):
        first = asyncio.ensure_future(asgi(app, "POST", "/v1/completions", body))
        await asyncio.to_thread(parses.entered.acquire, timeout=30)
        refused = await asgi(app, "POST", "/v1/completions", body)
        parses.release.set()
        return await first, refused

    first, (status, headers, reply) = run(
        scenario, FakeOmni([text("Hi"), finish()]), **{bound: size * 3 // 2}
    )
    assert first[0] == 200, "a lone large body passes"
    error = json.loads(reply)["error"]
    assert (status, error["type"], error["code"]) == (429, "rate_limit_error", "resource_exhausted")
    assert headers["retry-after"] == "1" and "large request bodies" in error["message"]
