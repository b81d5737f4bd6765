"""The OpenAI front's request hygiene and model-free routes against a fake Omni servicer (as
test_openai_app.py): unknown top-level fields refused naming them (or taken with the switch on),
integral floats taken as integers, /version and /metrics behind the API key."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from omnistage.common.metrics import counter
from omnistage.services.gateway.openai.app import Front, FrontOptions
from omnistage.services.gateway.openai.fields import CHAT, IMAGES, MAX_NAMED, SPEECH
from omnistage.v1 import omni_pb2_grpc

from tests.services.gateway.test_openai_app import FakeOmni, asgi, chat_body, finish, text

KEY = "sk-extras"


def run(scenario, omni: FakeOmni, **options):
    """`scenario(app, omni)` with the front (API key KEY, `options`) on a fake Omni server."""

    async def main():
        server = grpc.aio.server()
        omni_pb2_grpc.add_OmniServicer_to_server(omni, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                front = Front(
                    channel,
                    FrontOptions(**options),
                    check_key=lambda md: (
                        "" if ("authorization", f"Bearer {KEY}") in md else "invalid API key"
                    ),
                )
                return await scenario(front.app(), omni)
        finally:
            await server.stop(0)

    return asyncio.run(main())


AUTH = {"authorization": f"Bearer {KEY}"}


def _post(path: str, body: bytes, **options):
    omni = FakeOmni([text("Hi"), finish()])

    async def scenario(app, omni):
        return await asgi(app, "POST", path, body)

    status, _, reply = run(scenario, omni, **options)
    return status, json.loads(reply), omni


@pytest.mark.parametrize(
    ("path", "body", "unknown"),
    [
        ("/v1/chat/completions", chat_body(max_token=5), ["max_token"]),
        ("/v1/chat/completions", chat_body(foo=1, bar=None), ["foo", "bar"]),
        ("/v1/audio/speech", json.dumps({"input": "Hi", "voices": "x"}).encode(), ["voices"]),
        ("/v1/images/generations", json.dumps({"prompt": "a cat", "steps": 2}).encode(), ["steps"]),
    ],
    ids=["chat-typo", "chat-two", "speech", "images"],
)
def test_unknown_top_level_fields_are_refused_naming_them(path, body, unknown):
    status, reply, omni = _post(path, body)
    error = reply["error"]
    assert status == 400 and error["param"] == unknown[0] and error["code"] == "unknown_parameter"
    assert error["message"].endswith("supplied: " + ", ".join(unknown))
    assert omni.requests == [], "refused before any Omni call"


def test_many_unknown_fields_are_named_up_to_a_bound():
    extra = {f"x{i}": i for i in range(MAX_NAMED + 5)}
    status, reply, _ = _post("/v1/chat/completions", chat_body(**extra))
    message = reply["error"]["message"]
    named = ", ".join(f"x{i}" for i in range(MAX_NAMED))
    assert status == 400 and message.endswith(f"supplied: {named} (and 5 more)")


def test_the_switch_takes_unknown_fields():
    status, reply, omni = _post("/v1/chat/completions", chat_body(foo=1), allow_unknown_fields=True)
    assert status == 200 and reply["choices"][0]["message"]["content"] == "Hi" and len(omni.requests) == 1


def test_every_documented_field_is_known():
    """The fields the translation reads are in the route's set (else a supported field is refused)."""
    assert {"max_tokens", "top_k", "stream_options", "seed", "user", "metadata", "store"} <= CHAT
    assert {"input", "voice", "stream_format", "instructions", "seed", "max_tokens"} <= SPEECH
    assert {"prompt", "size", "num_inference_steps", "guidance_scale", "seed"} <= IMAGES


def test_integral_floats_are_integers():
    status, reply, omni = _post("/v1/chat/completions", chat_body(max_tokens=8.0, n=1.0, seed=3.0, top_k=2.0))
    assert status == 200
    sp = omni.requests[0].sampling
    assert (sp.max_tokens, sp.seed, sp.top_k) == (8, 3, 2)
    status, reply, _ = _post("/v1/chat/completions", chat_body(max_tokens=8.5))
    assert (
        status == 400
        and reply["error"]["param"] == "max_tokens"
        and "an integer" in reply["error"]["message"]
    )


def test_prediction_and_web_search_are_refused_not_ignored():
    for key, value in (
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {"search_context_size": "low"}),
    ):
        status, reply, _ = _post("/v1/chat/completions", chat_body(**{key: value}))
        assert status == 400 and reply["error"]["param"] == key


def test_version_and_metrics_need_the_key_and_export_the_registry():
    probe = counter("extras_route_probe_total", "a series only this test writes")
    probe.labels(service="test").inc(3)

    async def scenario(app, omni):
        return [
            await asgi(app, "GET", "/version", headers=AUTH),
            await asgi(app, "GET", "/metrics", headers=AUTH),
            await asgi(app, "GET", "/version"),
            await asgi(app, "GET", "/metrics", headers={"authorization": "Bearer nope"}),
        ]

    (v_status, _, v_body), (m_status, m_headers, m_body), *refused = run(scenario, FakeOmni([]))
    assert v_status == 200 and json.loads(v_body)["version"]
    assert m_status == 200 and m_headers["content-type"].startswith("text/plain")
    assert 'omnistage_extras_route_probe_total{service="test"} 3.0' in m_body.decode()
    assert [s for s, _, _ in refused] == [401, 401]
