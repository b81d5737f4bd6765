"""The OpenAI front's request hygiene and model-free routes against a fake Omni servicer (as
test_openai_app.py): unknown top-level fields refused naming them (or taken with the switch on),
integral floats taken as integers, /version and /metrics behind the API key."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from omnistage.common.metrics import counter
from omnistage.services.gateway.openai.bodies import ImageBody, SpeechBody
from omnistage.services.gateway.openai.chat_body import ChatBody
from omnistage.services.gateway.openai.schema import MAX_NAMED
from omnistage.v1 import common_pb2, omni_pb2

from tests.services.gateway.test_openai_app import FakeOmni, asgi, chat_body, fake_front, finish, text

KEY = "sk-extras"


def run(scenario, omni: FakeOmni, **options):
    """`scenario(app, omni)` with the front (API key KEY, `options`) on a fake Omni server."""

    async def main():
        async with fake_front(omni, check_key=_check_key, **options) as front:
            return await scenario(front.app(), omni)

    return asyncio.run(main())


def _check_key(metadata) -> str:
    return "" if ("authorization", f"Bearer {KEY}") in metadata else "invalid API key"


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
    """The fields the translation reads are in the route's model (else a supported field is refused)."""
    assert {"max_tokens", "top_k", "stream_options", "seed", "user", "metadata", "store"} <= set(
        ChatBody.model_fields
    )
    assert {"input", "voice", "stream_format", "instructions", "seed", "max_tokens"} <= set(
        SpeechBody.model_fields
    )
    assert {"prompt", "size", "num_inference_steps", "guidance_scale", "seed"} <= set(ImageBody.model_fields)


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


def lp_text(t: str, token_id: int, logprob: float) -> omni_pb2.GenerateEvent:
    """A text delta of one token with its logprobs (the second alternative a partial character)."""
    return omni_pb2.GenerateEvent(
        text=omni_pb2.TextDelta(
            text=t,
            token_ids=[token_id],
            logprobs=[
                common_pb2.TokenLogprobs(
                    token_id=token_id,
                    logprob=logprob,
                    token=t.encode(),
                    top_token_ids=[token_id, 99],
                    top_logprobs=[logprob, logprob - 1],
                    top_tokens=[t.encode(), b"\xe4"],
                )
            ],
        )
    )


def finish_of(completion: int, cached: int) -> omni_pb2.GenerateEvent:
    return omni_pb2.GenerateEvent(
        finish=omni_pb2.Finish(
            reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(
                prompt_tokens=40, completion_tokens=completion, cached_prompt_tokens=cached
            ),
        )
    )


class ChoicesOmni(FakeOmni):
    """Call k answers `answers[k]`; `log` records each call's arrival and its first event, in order;
    the call numbered `refuse` is refused (RESOURCE_EXHAUSTED) at arrival."""

    def __init__(self, answers: list[list[omni_pb2.GenerateEvent]], refuse: int = -1) -> None:
        super().__init__([])
        self.answers = answers
        self.refuse = refuse
        self.log: list[str] = []

    async def Generate(self, request, context):
        k = len(self.requests)
        self.requests.append(request)
        self.log.append(f"call{k}")
        if k == self.refuse:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "thinker full")
        try:
            if k == 0:
                await asyncio.sleep(0.2)  # the prompt's prefill: the other choices must wait for it
            for i, event in enumerate(self.answers[k]):
                if i == 0:
                    self.log.append(f"first{k}")
                yield event
            await asyncio.sleep(self.end_delay_s)
            self.completed += 1
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def _answers() -> list[list[omni_pb2.GenerateEvent]]:
    return [
        [lp_text("A", 1, -0.25), lp_text("b", 2, -0.5), finish_of(2, 0)],
        [lp_text("C", 3, -1.0), finish_of(1, 32)],
        [lp_text("D", 4, -2.0), lp_text("e", 5, -0.125), lp_text("f", 6, -0.5), finish_of(3, 32)],
    ]


def test_n_choices_open_after_the_first_prompt_with_their_own_seeds_and_logprobs():
    omni = ChoicesOmni(_answers())

    async def scenario(app, omni):
        body = chat_body(n=3, seed=7, logprobs=True, top_logprobs=2)
        return await asgi(app, "POST", "/v1/chat/completions", body)

    status, _, reply = run(scenario, omni)
    body = json.loads(reply)
    assert status == 200, body
    log = omni.log
    assert log[:2] == ["call0", "first0"] and log.index("call1") > 1 and log.index("call2") > 1
    assert [r.sampling.seed for r in omni.requests] == [7, 8, 9]
    assert all(r.sampling.logprobs == 2 for r in omni.requests)
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [
        (0, "Ab"),
        (1, "C"),
        (2, "Def"),
    ]
    assert body["usage"] == {
        "prompt_tokens": 40,
        "completion_tokens": 6,
        "total_tokens": 46,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    content = body["choices"][2]["logprobs"]["content"]
    assert [(t["token"], t["logprob"], t["bytes"]) for t in content] == [
        ("D", -2.0, [68]),
        ("e", -0.125, [101]),
        ("f", -0.5, [102]),
    ]
    top = content[0]["top_logprobs"]
    assert [t["logprob"] for t in top] == [-2.0, -3.0] and top[1] == {
        "token": "\ufffd",
        "logprob": -3.0,
        "bytes": [0xE4],
    }


def test_n_choices_stream_by_index_with_logprobs_and_one_usage():
    omni = ChoicesOmni(_answers())

    async def scenario(app, omni):
        body = chat_body(n=3, stream=True, logprobs=True, stream_options={"include_usage": True})
        return await asgi(app, "POST", "/v1/chat/completions", body)

    status, _, reply = run(scenario, omni)
    lines = [line[6:] for line in reply.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    texts, finishes, logprobs = {0: "", 1: "", 2: ""}, {}, {0: [], 1: [], 2: []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
        if choice["logprobs"]:
            logprobs[choice["index"]] += choice["logprobs"]["content"]
    assert texts == {0: "Ab", 1: "C", 2: "Def"} and finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert [t["logprob"] for t in logprobs[2]] == [-2.0, -0.125, -0.5]
    assert all(t["top_logprobs"] == [] for t in logprobs[0]), "top_logprobs 0: the chosen token only"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert (omni.completed, omni.cancelled) == (3, 0)


def test_a_refused_choice_refuses_the_request_and_cancels_the_others():
    answers = _answers()
    answers[0] = [lp_text("A", 1, -0.25)]  # a long answer: it would still run
    omni = ChoicesOmni(answers, refuse=2)
    omni.end_delay_s = 30

    async def scenario(app, omni):
        reply = await asgi(app, "POST", "/v1/chat/completions", chat_body(n=3))
        for _ in range(500):  # at most 5 s for the cancels to reach the server
            if omni.cancelled + omni.completed >= 2:
                break
            await asyncio.sleep(0.01)
        return reply

    status, _, reply = run(scenario, omni)
    assert status == 429 and "thinker full" in json.loads(reply)["error"]["message"]
    assert len(omni.requests) == 3 and (omni.cancelled, omni.completed) == (2, 0), "none runs for nobody"


def multipart(fields: dict[str, str], file: tuple[str, bytes] | None) -> tuple[bytes, str]:
    boundary = "omnistage-test-boundary"
    out = b""
    for key, value in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode()
    if file is not None:
        name, data = file
        out += (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n"
            ).encode()
            + data
            + b"\r\n"
        )
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _transcribe(fields: dict[str, str], file=("speech.wav", b"RIFF-not-really"), **options):
    omni = FakeOmni([text(" Hello world. "), finish()])
    body, kind = multipart(fields, file)

    async def scenario(app, omni):
        return await asgi(app, "POST", "/v1/audio/transcriptions", body, headers={"content-type": kind})

    status, headers, reply = run(scenario, omni, **options)
    return status, headers, reply, omni


def test_a_transcription_asks_the_release_asr_prompt_with_the_audio():
    from omnistage.services.gateway.openai.transcriptions import ASR_INSTRUCTION

    status, _, reply, omni = _transcribe({"model": "m", "prompt": "Names: Zelle."})
    assert status == 200 and json.loads(reply)["text"] == "Hello world."
    (message,) = omni.requests[0].messages
    assert message.parts[0].text == ASR_INSTRUCTION + " Names: Zelle."
    assert (
        message.parts[1].audio.data == b"RIFF-not-really" and message.parts[1].audio.mime_type == "audio/wav"
    )
    assert omni.requests[0].sampling.temperature == 0.0, "greedy unless asked"
    status, headers, reply, _ = _transcribe({"model": "m", "response_format": "text"})
    assert status == 200 and reply == b"Hello world." and headers["content-type"].startswith("text/plain")
    status, _, reply, _ = _transcribe({"model": "m", "response_format": "verbose_json", "language": "en"})
    body = json.loads(reply)
    assert (body["task"], body["language"], body["text"], body["duration"]) == (
        "transcribe",
        "en",
        "Hello world.",
        0.0,
    )


@pytest.mark.parametrize(
    ("fields", "file", "param"),
    [
        ({"model": "m"}, None, "file"),
        ({"model": "m", "response_format": "srt"}, ("a.wav", b"x"), "response_format"),
        ({"model": "m", "temperature": "hot"}, ("a.wav", b"x"), "temperature"),
        ({"model": "m", "speaker": "x"}, ("a.wav", b"x"), "speaker"),
        ({"model": "m", "timestamp_granularities[]": "word"}, ("a.wav", b"x"), "timestamp_granularities[]"),
        ({"model": "m"}, ("a.wav", b""), "file"),
    ],
    ids=["no-file", "srt", "temperature", "unknown", "timestamps", "empty"],
)
def test_bad_transcription_forms_are_400_naming_the_field(fields, file, param):
    status, _, reply, omni = _transcribe(fields, file)
    assert status == 400 and json.loads(reply)["error"]["param"] == param, reply
    assert omni.requests == []


def test_a_transcription_needs_a_multipart_upload():
    omni = FakeOmni([])

    async def scenario(app, omni):
        return await asgi(app, "POST", "/v1/audio/transcriptions", b"{}")

    status, _, reply = run(scenario, omni)
    assert status == 400 and json.loads(reply)["error"]["param"] == "content-type"


def _complete(body: dict, answers=None):
    omni = ChoicesOmni(answers or _answers())

    async def scenario(app, omni):
        return await asgi(app, "POST", "/v1/completions", json.dumps(body).encode())

    status, _, reply = run(scenario, omni)
    return status, reply, omni


def test_completions_continue_the_raw_prompt_with_choices_and_legacy_logprobs():
    status, reply, omni = _complete({"model": "m", "prompt": ["Once upon"], "n": 3, "logprobs": 2, "seed": 1})
    body = json.loads(reply)
    assert status == 200 and body["object"] == "text_completion"
    request = omni.requests[0]
    assert request.prompt == "Once upon" and not request.messages
    assert request.sampling.max_tokens == 16 and request.sampling.logprobs == 2, "OpenAI's default 16"
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "Ab"), (1, "C"), (2, "Def")]
    lps = body["choices"][2]["logprobs"]
    assert lps["tokens"] == ["D", "e", "f"] and lps["token_logprobs"] == [-2.0, -0.125, -0.5]
    assert lps["text_offset"] == [0, 1, 2] and lps["top_logprobs"][0] == {"D": -2.0, "\ufffd": -3.0}
    assert body["usage"]["completion_tokens"] == 6


def test_completions_stream_by_index():
    status, reply, omni = _complete(
        {"prompt": "Once", "n": 2, "stream": True, "stream_options": {"include_usage": True}}, _answers()[:2]
    )
    lines = [line[6:] for line in reply.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {0: "Ab", 1: "C"} and chunks[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": [[1, 2], [3]]}, "prompt"),  # two token-array prompts
        ({"prompt": [1 << 40]}, "prompt"),  # not a 32-bit id
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "suffix": "z"}, "suffix"),
        ({"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "messages": []}, "messages"),
    ],
)
def test_bad_completion_bodies_are_400_naming_the_field(extra, param):
    status, reply, omni = _complete(extra)
    assert status == 400 and json.loads(reply)["error"]["param"] == param, reply
    assert omni.requests == []


def test_a_token_array_prompt_goes_as_prompt_token_ids():
    from omnistage.services.gateway.openai.translate import completion_request

    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        request = completion_request({"model": "m", "prompt": prompt}).request
        assert list(request.prompt_token_ids) == [5, 6, 7] and not request.prompt
    assert completion_request({"model": "m", "prompt": "Once"}).request.prompt == "Once"


def test_tokenize_and_detokenize_bodies():
    from omnistage.services.gateway.openai.errors import HttpError
    from omnistage.services.gateway.openai.tokens_routes import detokenize_request, tokenize_request

    assert tokenize_request({"prompt": "Once"})[0].prompt == "Once"
    asked, _ = tokenize_request(
        {"messages": [{"role": "user", "content": "Hi"}], "tools": [], "tool_choice": "none"}
    )
    assert asked.messages[0].parts[0].text == "Hi" and not asked.prompt
    assert list(detokenize_request({"tokens": [1, 2]}).token_ids) == [1, 2]
    for fn, body, param in (
        (tokenize_request, {"prompt": ""}, "prompt"),
        (tokenize_request, {"prompt": "a", "messages": []}, "prompt"),
        (tokenize_request, {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
        (detokenize_request, {"tokens": ["a"]}, "tokens[0]"),
        (detokenize_request, {"tokens": [2**40]}, "tokens"),
        (detokenize_request, {"tokens": [True]}, "tokens[0]"),
    ):
        with pytest.raises(HttpError) as info:
            fn(body)
        assert info.value.param == param
