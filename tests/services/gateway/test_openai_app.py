"""The OpenAI front's routes against a fake Omni servicer over real gRPC (driven as ASGI, in one loop):
errors in the OpenAI shape, a finished answer's call ends by itself (never counted as a cancel),
speech refused before audio, /ready per capability."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from omnistage.services.gateway.openai.app import INLINE_PARSE_BYTES, MAX_JSON_VALUES, Front, FrontOptions
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

CAPS = ("text", "media_input", "speech")


class FakeOmni(omni_pb2_grpc.OmniServicer):
    """Answers with `events`, then takes `end_delay_s` to return (the gateway's own clean-up)."""

    def __init__(self, events: list[omni_pb2.GenerateEvent], end_delay_s: float = 0.0) -> None:
        self.events = events
        self.end_delay_s = end_delay_s
        self.requests: list[omni_pb2.GenerateRequest] = []
        self.cancelled = 0
        self.completed = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        try:
            for event in self.events:
                yield event
            await asyncio.sleep(self.end_delay_s)
            self.completed += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def text(t: str) -> omni_pb2.GenerateEvent:
    return omni_pb2.GenerateEvent(text=omni_pb2.TextDelta(text=t))


def finish(**audio) -> omni_pb2.GenerateEvent:
    return omni_pb2.GenerateEvent(
        finish=omni_pb2.Finish(
            reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2),
            audio=omni_pb2.AudioStatus(**audio),
        )
    )


async def asgi(
    app,
    method: str,
    path: str,
    body: bytes = b"",
    query: str = "",
    leave: asyncio.Event | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict, bytes]:
    """One request through the ASGI app: (status, headers, whole body); the client disconnects when
    `leave` is set. `headers` replace the defaults (a JSON content type); a None value drops one."""
    sent = {"content-type": "application/json", "content-length": str(len(body)), **(headers or {})}
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": [(k.encode(), v.encode("latin-1")) for k, v in sent.items() if v is not None],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    delivered, out = False, {"status": 0, "headers": {}, "body": b""}

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await (leave or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    await asyncio.wait_for(app(scope, receive, send), 10)
    return out["status"], out["headers"], out["body"]


@contextlib.asynccontextmanager
async def fake_front(omni: FakeOmni, statuses: dict[str, int] | None = None, check_key=None, **options):
    """The front (FrontOptions `options`) on a fake Omni server (and its health)."""
    server = grpc.aio.server()
    omni_pb2_grpc.add_OmniServicer_to_server(omni, server)
    checker = health.aio.HealthServicer()
    for name, status in (statuses or {}).items():
        await checker.set(name, status)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            front = Front(channel, FrontOptions(**options), check_key=check_key)
            try:
                yield front
            finally:
                front.close()
    finally:
        await server.stop(0)


def run(scenario, omni: FakeOmni, statuses: dict[str, int] | None = None, **options):
    """`scenario(app, omni)` with the front on a fake Omni server; `options` are FrontOptions."""

    async def main():
        options.setdefault("capabilities", CAPS)
        options.setdefault("max_body_bytes", 4 << 20)
        async with fake_front(omni, statuses, **options) as front:
            return await scenario(front.app(), omni)

    return asyncio.run(main())


def chat_body(**kw) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **kw}).encode()


def test_bad_bodies_and_routes_get_openai_errors():
    async def scenario(app, omni):
        return [
            await asgi(app, "POST", "/v1/chat/completions", b"{"),
            await asgi(app, "POST", "/v1/chat/completions", b"[" * 100_000),
            await asgi(app, "POST", "/v1/chat/completions", b""),
            await asgi(app, "GET", "/v1/nothing"),
            await asgi(app, "GET", "/v1/chat/completions"),
        ]

    replies = run(scenario, FakeOmni([]))
    errors = [(status, json.loads(body)["error"]) for status, _, body in replies]
    assert [(s, e["param"]) for s, e in errors[:3]] == [(400, "body")] * 3
    assert "not valid JSON" in errors[0][1]["message"] and "nested too deeply" in errors[1][1]["message"]
    assert [s for s, _ in errors[3:]] == [404, 405]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat_body(stream="yes"), "stream"),
        ("/v1/chat/completions", chat_body(stream=1), "stream"),
        ("/v1/chat/completions", chat_body(stream="false"), "stream"),
        (
            "/v1/chat/completions",
            chat_body(stream=True, stream_options={"include_usage": "yes"}),
            "stream_options.include_usage",
        ),
        ("/v1/images/generations", json.dumps({"prompt": "a cat", "stream": "no"}).encode(), "stream"),
    ],
    ids=["chat-yes", "chat-1", "chat-false-string", "include_usage-yes", "image-no"],
)
def test_stream_flags_must_be_json_booleans(path, body, param):
    omni = FakeOmni([text("Hi"), finish()])

    async def scenario(app, omni):
        return await asgi(app, "POST", path, body)

    status, _, reply = run(scenario, omni)
    assert status == 400
    assert json.loads(reply)["error"]["param"] == param
    assert "expected a boolean (true or false)" in json.loads(reply)["error"]["message"]
    assert omni.requests == [], "refused before any Omni call"


@pytest.mark.parametrize(
    ("headers", "param", "needle"),
    [
        ({"content-type": "text/plain"}, "content-type", "expected application/json, got 'text/plain'"),
        ({"content-type": "application/x-www-form-urlencoded"}, "content-type", "expected application/json"),
        ({"content-type": None}, "content-type", "no Content-Type was sent"),
        ({"x-request-id": "r" * 257}, "x-request-id", "at most 256 characters"),
        ({"x-request-id": "abc\x01def"}, "x-request-id", "must be printable"),
    ],
)
def test_what_the_front_would_guess_is_refused(headers, param, needle):
    omni = FakeOmni([text("Hi"), finish()])

    async def scenario(app, omni):
        return await asgi(app, "POST", "/v1/chat/completions", chat_body(), headers=headers)

    status, reply_headers, reply = run(scenario, omni)
    error = json.loads(reply)["error"]
    assert (status, error["param"], error["type"]) == (400, param, "invalid_request_error")
    assert needle in error["message"]
    assert "x-request-id" not in reply_headers, "an invalid id is not echoed"
    assert omni.requests == []


def test_a_valid_request_id_and_a_json_content_type_with_parameters_are_taken():
    omni = FakeOmni([text("Hi"), finish()])

    async def scenario(app, omni):
        return await asgi(
            app,
            "POST",
            "/v1/chat/completions",
            chat_body(stream=None),
            headers={"content-type": "Application/JSON; charset=utf-8", "x-request-id": "req-7"},
        )

    status, headers, reply = run(scenario, omni)
    assert status == 200 and headers["x-request-id"] == "req-7"
    assert json.loads(reply)["choices"][0]["message"]["content"] == "Hi"
    assert [r.request_id for r in omni.requests] == ["req-7"]


def test_a_finished_streamed_answer_ends_its_call_itself():
    omni = FakeOmni([text("Hel"), text("lo"), finish()], end_delay_s=0.2)

    async def scenario(app, omni):
        return await asgi(app, "POST", "/v1/chat/completions", chat_body(stream=True))

    status, headers, body = run(scenario, omni)
    lines = [line for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "stop"
    assert "".join(json.loads(x[6:])["choices"][0]["delta"].get("content", "") for x in lines[:-1]) == "Hello"
    assert (omni.completed, omni.cancelled) == (1, 0), "the gateway would count a cancel"


def test_a_body_of_too_many_json_values_is_refused_before_it_is_parsed():
    """`[{},{},...]`: counted, not parsed (the parser would hold the GIL, stalling the event loop)."""
    body = b'{"model": "m", "messages": [' + b"{}," * MAX_JSON_VALUES + b'{"role": "user", "content": "Hi"}]}'

    async def scenario(app, omni):
        return await asgi(app, "POST", "/v1/chat/completions", body)

    omni = FakeOmni([text("ok"), finish()])
    status, _, reply = run(scenario, omni)
    error = json.loads(reply)["error"]
    assert (status, error["param"]) == (400, "body") and omni.requests == []
    values = sum(body.count(c) for c in (b"{", b"[", b","))
    assert (
        values > MAX_JSON_VALUES
        and error["message"] == f"body: {values} JSON objects, arrays and commas, at most {MAX_JSON_VALUES}"
    )


def test_a_large_body_is_translated_whole():
    big = "x" * (INLINE_PARSE_BYTES + 1)

    async def scenario(app, omni):
        return await asgi(
            app,
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "m", "messages": [{"role": "user", "content": big}]}).encode(),
        )

    omni = FakeOmni([text("ok"), finish()])
    status, _, body = run(scenario, omni)
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "ok"
    assert omni.requests[0].messages[0].parts[0].text == big


def test_a_client_that_leaves_a_whole_answer_cancels_its_call():
    omni = FakeOmni([text("Hel")], end_delay_s=30)  # an answer that takes long

    async def scenario(app, omni):
        leave = asyncio.Event()
        reply = asyncio.ensure_future(asgi(app, "POST", "/v1/chat/completions", chat_body(), leave=leave))
        while not omni.requests:
            await asyncio.sleep(0.01)
        leave.set()
        status = (await reply)[0]
        for _ in range(500):  # at most 5 s
            if omni.cancelled:
                break
            await asyncio.sleep(0.01)
        return status

    assert run(scenario, omni) == 499
    assert (omni.cancelled, omni.completed) == (1, 0), "the call goes on for nobody"


def test_speech_with_nothing_spoken_is_an_error_naming_why():
    omni = FakeOmni(
        [
            text("Hi"),
            finish(
                outcome=omni_pb2.AUDIO_OUTCOME_NONE,
                code="INVALID_ARGUMENT",
                message="talker: text: nothing to speak",
            ),
        ]
    )

    async def scenario(app, omni):
        return await asgi(app, "POST", "/v1/audio/speech", json.dumps({"input": "Hi"}).encode())

    status, _, body = run(scenario, omni)
    error = json.loads(body)["error"]
    assert status == 400 and error["message"] == "no speech: talker: text: nothing to speak"
    assert omni.cancelled == 0


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize(
    ("query", "expected"),
    [("", 200), ("capability=text", 200), ("capability=speech", 503), ("capability=image_output", 404)],
)
def test_ready_reports_each_capability(query, expected):
    statuses = {
        "": SERVING,
        "omnistage.v1.Omni.text": SERVING,
        "omnistage.v1.Omni.media_input": SERVING,
        "omnistage.v1.Omni.speech": NOT_SERVING,
    }

    async def scenario(app, omni):
        return await asgi(app, "GET", "/ready", query=query)

    status, _, body = run(scenario, FakeOmni([]), statuses)
    assert status == expected
    if expected != 404:
        assert json.loads(body)["capabilities"] == {"text": True, "media_input": True, "speech": False}
    else:
        assert json.loads(body)["error"]["param"] == "capability"


def test_ready_needs_the_thinker_though_the_gateway_serves():
    statuses = {
        "": SERVING,
        "omnistage.v1.Omni.text": NOT_SERVING,
        "omnistage.v1.Omni.media_input": NOT_SERVING,
        "omnistage.v1.Omni.speech": NOT_SERVING,
    }

    async def scenario(app, omni):
        return await asgi(app, "GET", "/ready")

    status, _, body = run(scenario, FakeOmni([]), statuses)
    assert (
        status == 503
        and json.loads(body)["status"] == "not_ready"
        and json.loads(body)["gateway"] == "SERVING"
    )
