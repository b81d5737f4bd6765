"""The bodies real clients send pass the OpenAI front's strict models (unknown fields refused at every
level): the official `openai` client's (driven over ASGI against a fake Omni servicer), and the shapes
langchain's ChatOpenAI and instructor send (their documented fields, as they write them)."""

from __future__ import annotations

import asyncio
import json

import httpx2
import openai
import pydantic
from omnistage.v1 import omni_pb2

from tests.services.gateway.test_openai_app import FakeOmni, asgi, fake_front, finish, run, text


class City(pydantic.BaseModel):
    city: str


def run_client(scenario, omni: FakeOmni):
    """`scenario(client, app)` with the official async client on the front's ASGI app."""

    async def main():
        async with fake_front(omni) as front:
            app = front.app()
            http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://front")
            client = openai.AsyncOpenAI(
                base_url="http://front/v1", api_key="k", http_client=http, max_retries=0
            )
            try:
                return await scenario(client, app)
            finally:
                await client.close()

    return asyncio.run(main())


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": True,
    },
}


def test_the_official_client_chats_with_tools_formats_and_streams():
    async def scenario(client, app):
        plain = await client.chat.completions.create(
            model="m",
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
            ],
            temperature=0.2,
            top_p=0.9,
            max_completion_tokens=8,
            seed=3,
            stop=["END"],
            user="u1",
            metadata={"k": "v"},
            store=False,
            parallel_tool_calls=False,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "weather"}},
        )
        parsed = await client.chat.completions.parse(
            model="m", messages=[{"role": "user", "content": "Where?"}], response_format=City
        )
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
        )
        chunks = [chunk async for chunk in stream]
        completion = await client.completions.create(model="m", prompt="Once", max_tokens=4, logprobs=1)
        return plain, parsed, chunks, completion

    omni = FakeOmni([text('{"city": "Paris"}'), finish()])
    plain, parsed, chunks, completion = run_client(scenario, omni)
    assert plain.choices[0].message.content == '{"city": "Paris"}'
    assert parsed.choices[0].message.parsed == City(city="Paris")
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5
    assert completion.choices[0].text == '{"city": "Paris"}'
    first = omni.requests[0]
    assert first.tool_choice == omni_pb2.TOOL_CHOICE_FUNCTION and first.sampling.max_tokens == 8
    assert json.loads(omni.requests[1].sampling.constraint.json_schema)["properties"] == {
        "city": {"title": "City", "type": "string"}
    }


def test_the_official_client_speaks_and_draws():
    async def scenario(client, app):
        speech = await client.audio.speech.create(model="m", input="Hi", voice="alloy", response_format="wav")
        return speech.read()

    audio = omni_pb2.GenerateEvent(audio=omni_pb2.AudioChunk(pcm16=b"\x01\x00", sample_rate_hz=16000))
    omni = FakeOmni([text("Hi"), audio, finish()])
    assert run_client(scenario, omni)[:4] == b"RIFF"
    assert omni.requests[0].voice == ""


LANGCHAIN_TURNS = [
    {"content": "You are helpful.", "role": "system"},
    {"content": "Weather in Paris?", "role": "user"},
    {
        "content": None,
        "role": "assistant",
        "tool_calls": [
            {
                "type": "function",
                "id": "call_1",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"content": "sunny", "role": "tool", "tool_call_id": "call_1"},
]
# What langchain's ChatOpenAI (bind_tools, with_structured_output) and instructor (TOOLS and JSON_SCHEMA
# modes) send: their fields, as they write them.
CLIENT_BODIES = [
    {
        "messages": LANGCHAIN_TURNS,
        "model": "m",
        "stream": False,
        "n": 1,
        "temperature": 0.7,
        "tools": [WEATHER],
        "parallel_tool_calls": False,
    },
    {
        "messages": LANGCHAIN_TURNS[:2],
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "City",
                "description": "A city.",
                "schema": City.model_json_schema(),
                "strict": True,
            },
        },
    },
    {
        "messages": [{"role": "user", "content": "Where?"}],
        "model": "m",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "City",
                    "description": "Correctly extracted `City`",
                    "parameters": City.model_json_schema(),
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "City"}},
        "max_tokens": 100,
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}
                ],
            }
        ],
        "model": "m",
        "max_completion_tokens": 10,
        "modalities": ["text", "audio"],
        "audio": {"voice": "coral", "format": "wav"},
    },
]


def test_langchain_and_instructor_bodies_pass():
    async def scenario(app, omni):
        return [
            await asgi(app, "POST", "/v1/chat/completions", json.dumps(b).encode()) for b in CLIENT_BODIES
        ]

    replies = run(scenario, FakeOmni([text("Hi"), finish()]))
    assert [status for status, _, _ in replies] == [200] * len(CLIENT_BODIES), [r[2][:300] for r in replies]
