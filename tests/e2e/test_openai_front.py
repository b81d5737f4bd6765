"""The OpenAI-compatible HTTP front end to end, through the official `openai` client, and the
`omnistage generate` / `bench` CLI, on the full tiny pipeline the e2e tests share (tests/e2e/full_pipeline.py:
one `omnistage serve` of gateway with API keys and gateway.http_port, encoder, thinker, talker, imagegen)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import socket
import time
import urllib.error
import urllib.request
import wave

import openai
import pytest

from tests.e2e import realtime_client as rc
from tests.e2e.full_pipeline import KEY
from tests.e2e.serve_pipeline import metric
from tests.services.encoder.media_samples import audio_file, image_bytes

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def front(shared_pipeline):
    """The full tiny pipeline the e2e tests share (tests/e2e/full_pipeline.py)."""
    return shared_pipeline


def _client(front, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=front["base"] + "/v1", api_key=key, max_retries=0, timeout=120)


def _in_flight(front) -> dict[str, float]:
    """Requests each service is running now (omnistage_rpc_in_flight)."""
    return {
        name: metric(url, f'omnistage_rpc_in_flight{{service="{name}"}}', 0.0)
        for name, url in front["metrics"].items()
    }


def _diagnostic(front, what: str) -> str:
    return f"{what}; in flight: {_in_flight(front)}\n--- omnistage serve ---\n{front['serve'].logs()}"


def _settled(front, timeout_s: float = 30.0) -> None:
    """Every request has ended in the gateway (a request left running there is a hang: fail, naming it)."""
    deadline = time.monotonic() + timeout_s
    while _in_flight(front)["gateway"]:
        if time.monotonic() > deadline:
            pytest.fail(
                _diagnostic(front, f"the gateway still runs a request {timeout_s:g}s after its answer")
            )
        time.sleep(0.1)


def _png_url(w: int = 64, h: int = 48) -> str:
    return "data:image/png;base64," + base64.b64encode(image_bytes(w, h, seed=5)).decode()


def test_chat_completion_text(front):
    r = _client(front).chat.completions.create(
        model="ming-flash-omni-2.0",
        messages=[{"role": "user", "content": "Hello there!"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and choice.message.content
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    # Asked again: the thinker's prefix cache serves the prompt's whole blocks of 16 (engine.block_size)
    # but the last token's, and OpenAI's usage says so.
    again = _client(front).chat.completions.create(
        model="ming-flash-omni-2.0",
        messages=[{"role": "user", "content": "Hello there!"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.usage.prompt_tokens_details.cached_tokens == (r.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert again.choices[0].message.content == choice.message.content


def _cancelled(front) -> float:
    return metric(
        front["metrics"]["gateway"],
        'omnistage_rpc_requests_total{code="CANCELLED",method="Generate",service="gateway"}',
        0.0,
    )


def test_chat_completion_streams_deltas_and_usage(front):
    client = _client(front)
    cancelled = _cancelled(front)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    stream = client.chat.completions.create(
        model="m",
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2, "text must stream"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    full = client.chat.completions.create(
        model="m", messages=messages, max_tokens=10, temperature=0, seed=3, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].message.content == text, "greedy: streamed and whole answers agree"
    _settled(front)
    assert _cancelled(front) == cancelled, "a streamed answer that finished is not counted as a client cancel"


def test_chat_with_an_image_and_audio_input(front):
    content = [
        {"type": "text", "text": "Describe the image and the sound."},
        {"type": "image_url", "image_url": {"url": _png_url()}},
        {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(audio_file("wav", 0.5)).decode(), "format": "wav"},
        },
    ]
    r = _client(front).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": content}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 6
    text_only = _client(front).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Describe the image and the sound."}],
        max_tokens=1,
        temperature=0,
    )
    assert r.usage.prompt_tokens > text_only.usage.prompt_tokens + 4, "the media rows count as prompt tokens"


def test_chat_with_spoken_answer(front):
    client = _client(front)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hello."}],
        modalities=["text", "audio"],
        audio={"voice": "DB30", "format": "wav"},
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    audio = r.choices[0].message.audio
    assert audio.transcript == r.choices[0].message.content
    with wave.open(io.BytesIO(base64.b64decode(audio.data))) as w:
        assert w.getframerate() == 44100 and w.getsampwidth() == 2 and w.getnchannels() == 1
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hello."}],
        modalities=["text", "audio"],
        audio={"voice": "DB30", "format": "pcm16"},
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    audios = [_as_dict(c.choices[0].delta.audio) for c in stream if c.choices and c.choices[0].delta.audio]
    pcm = b"".join(base64.b64decode(a["data"]) for a in audios if a.get("data"))
    status = [a for a in audios if "outcome" in a]
    assert len(status) == 1 and status[0]["outcome"] in ("complete", "partial", "none")
    assert len(pcm) % 2 == 0 and (pcm or status[0]["outcome"] == "none")


def _as_dict(obj) -> dict:
    return obj if isinstance(obj, dict) else obj.model_dump()


def test_wrong_key_is_401(front):
    with pytest.raises(openai.AuthenticationError) as info:
        _client(front, "sk-wrong").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}]
        )
    assert info.value.status_code == 401 and "invalid key: this port takes the API key" in str(info.value)
    assert "sk-wrong" not in str(info.value)
    with pytest.raises(urllib.error.HTTPError) as missing:  # no key at all: the 401 says how to send one
        urllib.request.urlopen(front["base"] + "/v1/models", timeout=30)
    assert missing.value.code == 401
    assert "the header 'Authorization: Bearer <key>'" in json.loads(missing.value.read())["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        _client(front, "sk-wrong").models.list()


def test_bad_input_is_400_naming_the_field(front):
    client = _client(front)
    with pytest.raises(openai.BadRequestError) as info:  # refused by the gateway's validation (gRPC)
        client.chat.completions.create(model="m", messages=[{"role": "assistant", "content": "Hi"}])
    assert "last message must be from ROLE_USER" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:  # refused by the translation
        client.chat.completions.create(
            model="m",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}],
                }
            ],
        )
    assert "only data: URLs" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:  # an image the encoder cannot decode
        client.chat.completions.create(
            model="m",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
                        {"type": "text", "text": "What is it?"},
                    ],
                }
            ],
        )
    assert "messages[0].parts[0]" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], temperature=5)
    with pytest.raises(openai.BadRequestError) as info:  # refused by the gateway's image checks
        client.images.generate(model="m", prompt="a cat", size="100x100")
    assert "image.width: 100 is not a multiple of 16" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:  # refused by the translation
        client.images.generate(model="m", prompt="a cat", size="big")
    assert "size" in str(info.value)


def test_images_generation_gives_a_png_of_the_size(front):
    from PIL import Image

    r = _client(front).images.generate(
        model="m", prompt="A red bicycle.", size="96x64", extra_body={"num_inference_steps": 2, "seed": 1}
    )
    with Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))) as png:
        assert png.format == "PNG" and png.size == (96, 64)
    assert r.usage.input_tokens > 0


def _raw(front, path: str, body: bytes | None = None, key: str = KEY) -> tuple[int, dict, bytes]:
    """One HTTP request; no answer within 60 s fails the test with what every service is running."""
    req = urllib.request.Request(
        front["base"] + path,
        data=body,
        method="POST" if body is not None else "GET",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
    except TimeoutError:
        pytest.fail(_diagnostic(front, f"no answer to {path} within 60s"))


def test_models_health_ready_and_limits(front):
    models = _client(front).models.list()
    assert [m.id for m in models.data] == ["ming-flash-omni-2.0"]
    assert _raw(front, "/health")[0] == 200
    status, _, body = _raw(front, "/ready")
    assert status == 200 and json.loads(body) == {
        "status": "ready",
        "gateway": "SERVING",
        "capabilities": {"text": True, "media_input": True, "speech": True, "image_output": True},
    }
    assert (
        _raw(front, "/ready?capability=speech")[0] == 200
        and _raw(front, "/ready?capability=image_output")[0] == 200
    )
    status, _, body = _raw(front, "/ready?capability=video")
    assert status == 404 and json.loads(body)["error"]["param"] == "capability"
    status, _, body = _raw(front, "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    host, port = front["base"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # refused before the body is sent
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (5 << 20)
        )
        reply = b""
        while b"request_too_large" not in reply and (data := sock.recv(65536)):
            reply += data
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "request_too_large" in reply


def _speech(front, **body) -> tuple[int, dict, bytes]:
    return _raw(front, "/v1/audio/speech", json.dumps({"model": "m", **body}).encode())


def _spoken_or_why_not(status: int, body: bytes) -> bool:
    """True for speech; else the tiny thinker's answer had nothing speakable: an error naming why."""
    if status == 200:
        return True
    assert status in (400, 500, 503) and "no speech" in json.loads(body)["error"]["message"], body[:300]
    return False


def test_speech_endpoint_pcm_wav_and_sse(front):
    status, headers, body = _speech(
        front, input="Hello there.", voice="DB30", response_format="pcm", max_tokens=8
    )
    if _spoken_or_why_not(status, body):
        assert len(body) % 2 == 0 and int(headers["x-sample-rate"]) == 44100
    status, headers, body = _speech(front, input="Hello there.", voice="DB30", max_tokens=8)  # wav by default
    if _spoken_or_why_not(status, body):
        assert headers["content-type"] == "audio/wav" and body[:4] == b"RIFF" and body[8:12] == b"WAVE"
    status, headers, body = _speech(
        front, input="Hello there.", voice="DB30", max_tokens=8, stream_format="sse"
    )
    if _spoken_or_why_not(status, body):
        events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "speech.audio.done"
        assert all(len(base64.b64decode(e["audio"])) % 2 == 0 for e in events[:-1])
    try:  # the official client, streaming the body as it comes
        with _client(front).audio.speech.with_streaming_response.create(
            model="m", voice="DB30", input="Hello there.", response_format="pcm", extra_body={"max_tokens": 8}
        ) as r:
            pcm = b"".join(r.iter_bytes())
        assert r.headers["x-sample-rate"] == "44100" and pcm and len(pcm) % 2 == 0
    except openai.APIStatusError as err:
        assert _spoken_or_why_not(err.status_code, err.response.content) is False
    _settled(front)


def test_speech_with_an_unknown_voice_is_400_however_long_the_answer(front):
    """The talker refuses the voice while the answer's text waits for its verdict: the request must end
    (it once hung in the gateway when the answer was longer than the client buffer)."""
    for input_text, max_tokens in (("Hi", None), ("Hello there, how are you? " * 8, 96)):
        status, _, body = _speech(
            front,
            input=input_text,
            voice="no-such-voice",
            **({"max_tokens": max_tokens} if max_tokens else {}),
        )
        error = json.loads(body)["error"]
        assert status == 400 and error["message"].startswith("voice: unknown voice 'no-such-voice'"), body
        _settled(front)


def test_bad_speech_bodies_are_400_naming_the_field(front):
    for body, param in (
        ({"input": ""}, "input"),
        ({"input": "Hi", "response_format": "mp3"}, "response_format"),
        ({"input": "Hi", "speed": 2.0}, "speed"),
        ({"input": "Hi", "voice": 5}, "voice"),
    ):
        status, _, raw = _speech(front, **body)
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw
    status, _, raw = _raw(front, "/v1/audio/speech", b"[1, 2]")
    assert status == 400 and json.loads(raw)["error"]["param"] == "body"


# ---- the OpenAI surface: n, logprobs, request hygiene, /version and /metrics


def _check_logprobs(choice, top: int, greedy: bool) -> None:
    """Every token has its logprob, `top` alternatives most likely first, and bytes that join to the text
    (the random tiny model also makes byte sequences that are no UTF-8: U+FFFD in the text)."""
    content = choice.logprobs.content
    joined = b"".join(bytes(t.bytes) for t in content).decode(errors="replace")
    assert joined == (choice.message.content or ""), content
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == top and tops == sorted(tops, reverse=True) and t.logprob <= 0
        assert sum(math.exp(x) for x in tops) <= 1 + 1e-4, "probabilities of distinct tokens"
        assert t.logprob <= tops[0] + 1e-5
        if greedy:
            assert t.logprob == pytest.approx(tops[0], abs=1e-5) and t.token == t.top_logprobs[0].token


def test_n_choices_share_the_prompt_through_the_prefix_cache_with_logprobs(front):
    client = _client(front)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Three samples of a story about a lighthouse keeper, please."}],
        n=3,
        max_tokens=5,
        temperature=1.0,
        seed=11,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15 and all(len(c.logprobs.content) == 5 for c in r.choices)
    # The later choices took the prompt's whole blocks (but the last token's) from the cache.
    assert r.usage.prompt_tokens_details.cached_tokens == (r.usage.prompt_tokens - 1) // 16 * 16 > 0
    for choice in r.choices:
        _check_logprobs(choice, 3, greedy=False)
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Two greedy answers."}],
        n=2,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            tokens[choice.index] += choice.logprobs.content if choice.logprobs else []
    assert texts[0] == texts[1] and len(tokens[0]) == len(tokens[1]) == 4, "greedy choices agree"
    assert [t.logprob for t in tokens[0]] == pytest.approx([t.logprob for t in tokens[1]], abs=1e-5)
    assert chunks[-1].usage.completion_tokens == 8
    _settled(front)


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Hangzhou", "Paris", "Lima"]},
        "rank": {"type": "integer", "minimum": 1, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["city", "rank", "tags"],
    "additionalProperties": False,
}


def test_structured_outputs_follow_their_schema_streamed_or_not(front):
    import jsonschema

    client = _client(front)
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": STRUCTURED_SCHEMA, "strict": True},
    }
    messages = [{"role": "user", "content": "Name a city as JSON."}]
    r = client.chat.completions.create(
        model="m", messages=messages, response_format=rf, max_tokens=200, temperature=1.0, seed=3
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), STRUCTURED_SCHEMA)
    stream = client.chat.completions.create(
        model="m", messages=messages, response_format=rf, max_tokens=200, temperature=1.0, seed=3, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content, "the same seed, streamed"
    r = client.chat.completions.create(
        model="m", messages=messages, response_format={"type": "json_object"}, max_tokens=200, temperature=0
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=messages, response_format=bad)
    assert "sampling.constraint.json_schema: does not compile" in str(info.value)
    _settled(front)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


def test_required_and_named_tool_calls_are_valid_calls_streamed_or_not(front):
    import jsonschema

    client = _client(front)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    r = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=1.0,
        seed=5,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    stream = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=1.0,
        seed=6,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0] and deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads(deltas[0].function.arguments), schemas["get_weather"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    # The call's result goes back as a tool message (the OBSERVATION turn); the model answers on.
    follow = client.chat.completions.create(
        model="m",
        messages=[
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
        ],
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens and follow.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m",
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "x"}},
        )
    assert "tool_choice_function: 'x' is not one of the tools" in str(info.value)
    _settled(front)


def test_what_outside_clients_tripped_on_is_answered_as_openai_does(front):
    """Issue 43: a forced call cut by max_tokens stays a call, an OpenAI voice name speaks, a lone
    surrogate or a typo below the top level is a 400 naming the field, a refusal of the Omni call names
    the body's field, a completions stream is not cached or buffered."""
    client = _client(front)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    cut = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, tool_choice="required", max_tokens=6, seed=1
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name in {"get_weather", "get_time"} or "get_weather".startswith(call.function.name)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=6,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    status, _, body = _speech(front, input="Hello there.", voice="alloy", max_tokens=8)
    assert status == 200 or _spoken_or_why_not(status, body) is False
    for raw, param in (
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usag": true}}',
            "stream_options.include_usag",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}',
            "max_tokens",
        ),
    ):
        status, _, body = _raw(front, "/v1/chat/completions", raw)
        assert status == 400 and json.loads(body)["error"]["param"] == param, body
    status, headers, _ = _raw(front, "/v1/completions", b'{"model": "m", "prompt": "Once", "stream": true}')
    headers = {k.lower(): v for k, v in headers.items()}
    assert status == 200 and headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    _settled(front)


def test_a_transcription_of_a_wav_returns_its_text(front):
    client = _client(front)
    wav = audio_file("wav", 1.0)
    r = client.audio.transcriptions.create(
        model="m", file=("speech.wav", wav), extra_body={"max_tokens": 6, "seed": 1}, temperature=0.5
    )
    assert isinstance(r.text, str) and r.text.strip() and r.usage.output_tokens == 6
    text_only = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "user", "content": "Please recognize the language of this speech and transcribe it."}
        ],
        max_tokens=1,
    )
    assert r.usage.input_tokens > text_only.usage.prompt_tokens + 4, "the audio rows are in the prompt"
    verbose = client.audio.transcriptions.create(
        model="m", file=("speech.wav", wav), response_format="verbose_json", extra_body={"max_tokens": 4}
    )
    assert verbose.duration == pytest.approx(1.0, abs=0.05) and isinstance(verbose.text, str)
    with pytest.raises(openai.BadRequestError) as info:  # the encoder cannot decode it
        client.audio.transcriptions.create(model="m", file=("speech.wav", b"not audio at all"))
    assert "messages[0].parts[1].audio" in str(info.value)
    _settled(front)


def test_completions_continue_a_raw_prompt_streamed_or_not(front):
    client = _client(front)
    whole = client.completions.create(
        model="m", prompt="Once upon a time", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = whole.choices[0]
    assert whole.object == "text_completion" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=1
    )
    assert whole.usage.prompt_tokens < chat.usage.prompt_tokens, "no chat format around a raw prompt"
    stream = client.completions.create(
        model="m",
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text, "greedy: the same text"
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs) == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="x", echo=True)
    assert "echo" in str(info.value)
    _settled(front)


def test_a_token_array_prompt_continues_like_its_text_and_no_special_token_passes(front):
    client = _client(front)
    status, _, raw = _raw(
        front, "/tokenize", json.dumps({"model": "m", "prompt": "Once upon a time"}).encode()
    )
    ids = json.loads(raw)["tokens"]
    assert status == 200 and ids
    text = client.completions.create(model="m", prompt="Once upon a time", max_tokens=5, temperature=0)
    tokens = client.completions.create(model="m", prompt=ids, max_tokens=5, temperature=0)
    assert tokens.choices[0].text == text.choices[0].text, "greedy: the same continuation"
    assert tokens.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model="m", prompt=[ids], max_tokens=5, temperature=0)  # one prompt
    assert batch.choices[0].text == text.choices[0].text
    status, _, raw = _raw(
        front,
        "/tokenize",
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode(),
    )
    special = json.loads(raw)["tokens"][0]  # the chat format opens with a special token
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt=[*ids, special], max_tokens=2)
    assert f"{special} is a special token" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt=[ids, ids], max_tokens=2)
    assert "one prompt per request" in str(info.value)
    _settled(front)


def test_tokenize_counts_what_generate_prefills_and_detokenize_reads_it_back(front):
    def post(path: str, body: dict, key: str = KEY):
        status, _, raw = _raw(front, path, json.dumps(body).encode(), key=key)
        return status, json.loads(raw)

    messages = [{"role": "user", "content": "Count my tokens, please."}]
    status, counted = post("/tokenize", {"model": "m", "messages": messages})
    chat = _client(front).chat.completions.create(model="m", messages=messages, max_tokens=1)
    assert status == 200 and counted["count"] == len(counted["tokens"]) == chat.usage.prompt_tokens
    assert counted["max_model_len"] == 1024
    status, raw = post("/tokenize", {"prompt": "Once upon a time"})
    completion = _client(front).completions.create(model="m", prompt="Once upon a time", max_tokens=1)
    assert status == 200 and raw["count"] == completion.usage.prompt_tokens
    status, text = post("/detokenize", {"tokens": raw["tokens"]})
    assert status == 200 and text["prompt"] == "Once upon a time"
    status, err = post("/detokenize", {"tokens": [10**9]})
    assert status == 400 and "token_ids" in err["error"]["message"]
    assert post("/tokenize", {"prompt": "x"}, key="sk-wrong")[0] == 401


def test_unknown_fields_are_400_and_the_api_port_serves_version_and_metrics(front):
    with pytest.raises(openai.BadRequestError) as info:
        _client(front).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], extra_body={"max_token": 5}
        )
    assert "Unrecognized request argument supplied: max_token" in str(info.value)
    status, _, body = _raw(front, "/version")
    assert status == 200 and json.loads(body)["version"]
    status, headers, body = _raw(front, "/metrics")
    assert (
        status == 200
        and 'omnistage_rpc_requests_total{code="OK",method="Generate",service="gateway"}' in (body.decode())
    )
    assert _raw(front, "/metrics", key="sk-wrong")[0] == 401


# ---- the CLI (common/client.py underneath) against the same gateway's gRPC port


def test_cli_generate_with_image_input_and_speech(front, tmp_path, monkeypatch, capsys):
    from omnistage.common.cli import main

    monkeypatch.setenv("FRONT_KEY", KEY)
    image = tmp_path / "in.png"
    image.write_bytes(image_bytes(64, 48, seed=2))
    out = tmp_path / "answer.wav"
    rc = main(
        [
            "generate",
            "--address",
            front["grpc"],
            "--api-key-env",
            "FRONT_KEY",
            "--prompt",
            "What is it?",
            "--image",
            str(image),
            "--speak",
            str(out),
            "--voice",
            "DB30",
            "--max-tokens",
            "6",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "[finish: " in captured.out and "completion_tokens=" in captured.out
    assert "[speech: " in captured.err
    with wave.open(str(out)) as w:
        assert w.getframerate() == 44100 and w.getnchannels() == 1


def test_cli_generate_image_out_writes_the_png_with_progress(front, tmp_path, monkeypatch, capsys):
    from omnistage.common.cli import main
    from PIL import Image

    monkeypatch.setenv("FRONT_KEY", KEY)
    rc = main(
        [
            "generate",
            "--address",
            front["grpc"],
            "--api-key-env",
            "FRONT_KEY",
            "--prompt",
            "A cat.",
            "--image-out",
            str(tmp_path / "cat.png"),
            "--image-size",
            "96x64",
            "--image-steps",
            "2",
            "--max-tokens",
            "4",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "/2]" in err and "[image: 96x64 written to" in err  # the denoising steps, then the file
    with Image.open(tmp_path / "cat.png") as png:
        assert png.size == (96, 64)
    assert (
        main(
            [
                "generate",
                "--address",
                front["grpc"],
                "--prompt",
                "x",
                "--image-out",
                "o.png",
                "--image-size",
                "big",
            ]
        )
        == 2
    )


def test_cli_bench_sweeps_concurrency(front, monkeypatch, capsys, tmp_path):
    from omnistage.common.cli import main

    monkeypatch.setenv("FRONT_KEY", KEY)
    rc = main(
        [
            "bench",
            "--address",
            front["grpc"],
            "--api-key-env",
            "FRONT_KEY",
            "--concurrency",
            "1,2",
            "--requests",
            "2",
            "--max-tokens",
            "4",
            "--kinds",
            "text,speech",
            "--json",
            str(tmp_path / "b.json"),
        ]
    )
    out = capsys.readouterr().out
    runs = json.loads((tmp_path / "b.json").read_text())
    assert [(r["kind"], r["load"], r["requests"]) for r in runs] == [
        ("text", "1", 2),
        ("text", "2", 2),
        ("speech", "1", 2),
        ("speech", "2", 2),
    ]
    assert all(r["ok"] == 2 and r["tok_per_s"] > 0 for r in runs if r["kind"] == "text"), out
    assert "| closed text | 1 | 2 |" in out and "| closed speech | 2 | 2" in out and "TTFA p50" in out
    # The tiny thinker's noise may leave nothing to speak: such speech counts as an error, text never does.
    assert rc == (1 if any(r["errors"] for r in runs) else 0)
    assert main(["bench", "--address", front["grpc"], "--kinds", "video"]) == 2


# ---- /v1/realtime (the official client's realtime connection)


def _realtime(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def _realtime_gauges(front) -> dict[str, float]:
    gw = front["metrics"]["gateway"]
    return {
        "sessions": metric(gw, 'omnistage_gateway_realtime_sessions{service="gateway"}', 0.0),
        "responses": metric(gw, 'omnistage_gateway_realtime_responses_active{service="gateway"}', 0.0),
        "kept_clips": metric(gw, 'omnistage_gateway_encode_cache_items{service="gateway"}', 0.0),
        **_in_flight(front),
    }


def _answered(response: dict) -> bool:
    """A whole answer: ended by the model, or by max_output_tokens (the tiny random model's usual end)."""
    if response["status"] == "incomplete":
        details = response["status_details"]
        return (details["type"], details["reason"]) == ("incomplete", "max_output_tokens")
    return response["status"] == "completed"


def _wait_realtime_idle(front) -> None:
    deadline = time.monotonic() + 60
    while any(_realtime_gauges(front).values()):
        assert time.monotonic() < deadline, _diagnostic(front, f"realtime left: {_realtime_gauges(front)}")
        time.sleep(0.1)


def test_realtime_text_turn_answers_with_audio_and_transcript(front):
    ttfa = 'omnistage_gateway_ttfa_seconds_count{service="gateway"'

    async def scenario():
        log: list = []
        async with rc.client(front["base"], KEY).realtime.connect(model=rc.MODEL) as conn:
            created = await rc.next_event(conn, log)
            await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
            updated = await rc.until(conn, log, "session.updated")
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}
            )
            await conn.response.create()
            done = await rc.until(conn, log, "response.done")
        return created, updated, done, log

    before = metric(front["metrics"]["gateway"], ttfa, 0.0)
    created, updated, done, log = _realtime(scenario())
    assert (
        created["type"] == "session.created"
        and created["session"]["audio"]["output"]["format"]["rate"] == 24000
    )
    assert updated["session"]["instructions"] == "Be brief."
    kinds = rc.types(log)
    order = ["conversation.item.created", "response.created", "response.output_item.added"]
    assert [k for k in kinds if k in order] == order
    assert kinds.index("response.output_audio.done") < kinds.index("response.done") == len(kinds) - 1
    response = done["response"]
    assert _answered(response) and response["usage"]["output_tokens"] > 0
    transcript = "".join(e["delta"] for e in log if e["type"] == "response.output_audio_transcript.delta")
    assert transcript and response["output"][0]["content"][0]["transcript"] == transcript
    assert len(rc.audio_of(log, response["id"])) > 0  # 24 kHz PCM16 from the talker's rate
    assert metric(front["metrics"]["gateway"], ttfa, 0.0) > before  # the turn's TTFA was observed
    _wait_realtime_idle(front)


def test_realtime_server_vad_commits_speech_and_answers_it(front):
    async def scenario():
        log: list = []
        async with rc.client(front["base"], KEY).realtime.connect(model=rc.MODEL) as conn:
            await conn.session.update(
                session={
                    "output_modalities": ["text"],
                    "audio": {
                        "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}
                    },
                }
            )
            await rc.until(conn, log, "session.updated")
            await rc.speak(conn)
            done = await rc.until(conn, log, "response.done")
        return done, log

    done, log = _realtime(scenario())
    kinds = rc.types(log)
    steps = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.created",
        "response.created",
        "response.done",
    ]
    assert [k for k in kinds if k in steps] == steps, kinds
    started = next(e for e in log if e["type"] == "input_audio_buffer.speech_started")
    stopped = next(e for e in log if e["type"] == "input_audio_buffer.speech_stopped")
    assert 200 <= started["audio_start_ms"] < stopped["audio_end_ms"] <= 1300
    assert _answered(done["response"])
    assert any(e["type"] == "response.output_text.delta" for e in log)
    assert not any(e["type"] == "response.output_audio.delta" for e in log)


def _cache_counts(front) -> dict[str, float]:
    """The gateway's encode cache counters (labels in the exposition's order: sorted by name)."""
    gw, name = front["metrics"]["gateway"], "omnistage_gateway_encode_cache"
    counts = {
        r: metric(gw, f'{name}_lookups_total{{result="{r}",service="gateway"}}', 0.0)
        for r in ("hit", "wait", "miss")
    }
    counts["ahead"] = metric(gw, f'{name}_ahead_total{{outcome="started",service="gateway"}}', 0.0)
    return counts


def test_realtime_spoken_turns_are_encoded_ahead_once_and_the_second_reuses_the_first_prefix(front):
    """Two spoken turns of one session (server VAD): each turn's clip went to the encoder when VAD first
    heard its silence last, before `speech_stopped` (the turn found it encoded or under way: no clip
    encoded after a commit); the second turn's prompt lends the first clip again (no second Encode of
    it), and the thinker takes the first turn's prompt from its prefix cache (`cached_tokens`). The
    session's end releases every kept clip (the idle check's `kept_clips`)."""

    async def scenario():
        log: list = []
        async with rc.client(front["base"], KEY).realtime.connect(model=rc.MODEL) as conn:
            vad = {"type": "server_vad", "silence_duration_ms": 300}
            await conn.session.update(
                session={
                    "output_modalities": ["text"],
                    "max_output_tokens": 8,
                    "audio": {"input": {"turn_detection": vad}},
                }
            )
            await rc.until(conn, log, "session.updated")
            dones = []
            for speech_s in (0.8, 0.7):  # two different clips
                await rc.speak(conn, rc.utterance(speech_s, 0.3, 0.6))
                dones.append(await rc.until(conn, log, "response.done"))
        return dones, log

    before = _cache_counts(front)
    dones, log = _realtime(scenario())
    _wait_realtime_idle(front)
    got = {k: v - before[k] for k, v in _cache_counts(front).items()}
    assert all(_answered(d["response"]) for d in dones)
    assert rc.types(log).count("input_audio_buffer.speech_stopped") == 2
    assert got["miss"] == 0, got  # no clip was encoded after its turn was committed
    assert got["hit"] + got["wait"] == 3, got  # turn 1: its clip; turn 2: the first one again and its own
    assert got["ahead"] >= 2, got
    # The second prompt begins with the first (its clip's rows the same bytes): every whole KV block of
    # it (engine.block_size 16) comes from the prefix cache.
    first, second = (d["response"]["usage"] for d in dones)
    assert second["input_token_details"]["cached_tokens"] >= first["input_tokens"] // 16 * 16 > 0


def test_realtime_barge_in_cancels_the_answer_and_the_next_one_answers(front):
    gw = front["metrics"]["gateway"]
    barge_ins = 'omnistage_gateway_realtime_barge_ins_total{service="gateway"}'

    async def scenario():
        log: list = []
        async with rc.client(front["base"], KEY).realtime.connect(model=rc.MODEL) as conn:
            await conn.session.update(
                session={
                    "max_output_tokens": 200,
                    "audio": {
                        "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}
                    },
                }
            )
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "A story."}],
                }
            )
            await conn.response.create()
            first = await rc.until(conn, log, "response.output_audio.delta")
            await rc.speak(conn)  # the user talks over the answer
            cancelled = await rc.until(conn, log, "response.done")
            answered = await rc.until(conn, log, "response.done")
        return first, cancelled, answered, log

    before = metric(gw, barge_ins, 0.0)
    first, cancelled, answered, log = _realtime(scenario())
    kinds = rc.types(log)
    assert cancelled["response"]["id"] == first["response_id"]
    assert cancelled["response"]["status"] == "cancelled"
    assert cancelled["response"]["status_details"]["reason"] == "turn_detected"
    assert kinds.index("input_audio_buffer.speech_started") < log.index(cancelled)
    # Nothing of the cancelled answer after its response.done.
    assert not [e for e in log[log.index(cancelled) + 1 :] if e.get("response_id") == first["response_id"]]
    assert answered["response"]["id"] != first["response_id"]
    assert _answered(answered["response"])
    assert metric(gw, barge_ins) == before + 1
    _wait_realtime_idle(front)


def test_realtime_manual_turns_and_cancel(front):
    async def scenario():
        log: list = []
        async with rc.client(front["base"], KEY).realtime.connect(model=rc.MODEL) as conn:
            await conn.session.update(
                session={"output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}
            )
            updated = await rc.until(conn, log, "session.updated")
            await rc.speak(conn)
            await conn.input_audio_buffer.commit()
            committed = await rc.until(conn, log, "input_audio_buffer.committed")
            await conn.response.create()
            done = await rc.until(conn, log, "response.done")
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "More."}]}
            )
            await conn.response.create()
            await rc.until(conn, log, "response.created")
            await conn.response.cancel()
            cancelled = await rc.until(conn, log, "response.done")
        return updated, committed, done, cancelled, log

    updated, committed, done, cancelled, log = _realtime(scenario())
    assert updated["session"]["audio"]["input"]["turn_detection"] is None
    assert "input_audio_buffer.speech_started" not in rc.types(log)  # no VAD: the client's turns
    assert committed["item_id"] and _answered(done["response"])
    assert cancelled["response"]["status"] == "cancelled"
    assert cancelled["response"]["status_details"]["reason"] == "client_cancelled"
    _wait_realtime_idle(front)


def test_realtime_bad_events_get_errors_and_the_session_goes_on(front):
    async def scenario():
        log: list = []
        async with rc.client(front["base"], KEY).realtime.connect(model=rc.MODEL) as conn:
            await rc.next_event(conn, log)  # session.created
            await conn.send_raw("{not json")
            bad_json = await rc.until(conn, log, "error")
            await conn.send_raw(json.dumps({"type": "response.dance", "event_id": "ev1"}))
            unknown = await rc.until(conn, log, "error")
            await conn.send_raw(
                json.dumps({"type": "input_audio_buffer.append", "audio": "***", "event_id": "ev2"})
            )
            bad_audio = await rc.until(conn, log, "error")
            await conn.send_raw(json.dumps({"type": "response.create", "event_id": "ev3"}))
            no_input = await rc.until(conn, log, "error")
            await conn.session.update(session={"audio": {"output": {"format": {"type": "audio/pcmu"}}}})
            bad_format = await rc.until(conn, log, "error")
            await conn.session.update(session={"instructions": "Still here."})
            updated = await rc.until(conn, log, "session.updated")
        return bad_json, unknown, bad_audio, no_input, bad_format, updated

    bad_json, unknown, bad_audio, no_input, bad_format, updated = _realtime(scenario())
    assert bad_json["error"]["code"] == "invalid_json"
    assert (unknown["error"]["event_id"], unknown["error"]["param"]) == ("ev1", "type")
    assert (bad_audio["error"]["event_id"], bad_audio["error"]["param"]) == ("ev2", "audio")
    assert (no_input["error"]["event_id"], no_input["error"]["code"]) == ("ev3", "response_without_input")
    assert bad_format["error"]["param"] == "session.audio.output.format"
    assert updated["session"]["instructions"] == "Still here."


def test_realtime_wrong_key_is_refused_at_the_handshake(front):
    async def scenario():
        async with rc.client(front["base"], "sk-wrong").realtime.connect(model=rc.MODEL) as conn:
            await conn.recv()

    with pytest.raises(Exception) as info:
        _realtime(scenario())
    assert "401" in str(info.value)


def test_realtime_socket_closed_mid_answer_ends_every_stage_stream(front):
    async def scenario():
        log: list = []
        async with rc.client(front["base"], KEY).realtime.connect(model=rc.MODEL) as conn:
            await conn.session.update(session={"max_output_tokens": 200})
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Go on."}],
                }
            )
            await conn.response.create()
            await rc.until(conn, log, "response.output_audio.delta")
            during = _realtime_gauges(front)
        return during

    during = _realtime(scenario())  # the socket closes with the answer still streaming
    assert during["sessions"] == 1 and during["responses"] == 1 and during["gateway"] == 1
    assert during["thinker"] + during["talker"] >= 1  # a stage stream is open when the socket goes
    _wait_realtime_idle(front)


def test_a_request_past_the_context_gets_the_context_rules_one_message_on_every_path(front):
    """The context rule has one owner (common/context_rule.py): max_tokens past the thinker's context
    is refused with the same words through gRPC Generate, gRPC Converse and the HTTP front."""
    import grpc
    from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

    max_tokens = 10**6
    auth = (("authorization", f"Bearer {KEY}"),)
    request = omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Hi.")])],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )

    def refusal(call) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        return err.value.code(), err.value.details()

    with grpc.insecure_channel(front["grpc"]) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        generate = refusal(stub.Generate(request, metadata=auth, timeout=60))
        config = omni_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
        converse = refusal(
            stub.Converse(iter([omni_pb2.ConverseRequest(config=config)]), metadata=auth, timeout=60)
        )
    status, _, body = _raw(
        front,
        "/v1/chat/completions",
        json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": max_tokens}
        ).encode(),
    )
    assert generate[0] == converse[0] == grpc.StatusCode.INVALID_ARGUMENT, (generate, converse)
    words = generate[1]
    assert words.startswith(f"sampling.max_tokens: {max_tokens} exceeds max_model_len "), generate
    assert words in converse[1], (generate, converse)
    assert status == 400 and words in json.loads(body)["error"]["message"], body
