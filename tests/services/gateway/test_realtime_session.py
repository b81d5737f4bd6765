"""The Realtime endpoint driven as an ASGI WebSocket app in one loop (a fake Converse call): keys checked
at the handshake (header and browser subprotocol form), session limits in all and per key, idle time
and session length, the audio buffer's bound, the session's settings fixed once it has begun, and its
Converse call opened ahead of its first turn."""

from __future__ import annotations

import asyncio
import base64
import json

import grpc
import pytest
from omnistage.common.runtime.auth import ApiKeys
from omnistage.services.gateway.openai.realtime import RealtimeEndpoint
from omnistage.services.gateway.openai.realtime_limits import RealtimeOptions
from omnistage.v1 import common_pb2, omni_pb2

from tests.services.gateway.realtime_audio import silence, utterance

KEY, OTHER = "sk-one", "sk-two"
KEYS = ApiKeys((KEY.encode(), OTHER.encode()), "test")


class FakeCall:
    """A Converse call that takes every message and answers each turn with one text delta + finish."""

    def __init__(self) -> None:
        self.written: list[omni_pb2.ConverseRequest] = []
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.turns = 0

    async def write(self, message: omni_pb2.ConverseRequest) -> None:
        self.written.append(message)
        if message.HasField("text") or message.end_of_turn:
            turn, self.turns = self.turns, self.turns + 1
            await self.events.put(omni_pb2.GenerateEvent(turn=turn, text=omni_pb2.TextDelta(text="Hi.")))
            await self.events.put(omni_pb2.GenerateEvent(turn=turn, finish=omni_pb2.Finish(reason=1)))

    async def read(self):
        return await self.events.get()

    def cancel(self) -> None:
        self.cancelled = True


class FakeStub:
    def __init__(self) -> None:
        self.calls: list[FakeCall] = []

    def Converse(self, metadata=(), timeout=None):  # noqa: N802 - the gRPC method's name
        self.calls.append(FakeCall())
        return self.calls[-1]


class Socket:
    """One client connection to `app`: what it sends in `sent`, what the test sends through `send`."""

    def __init__(self, app, key: str | None = KEY, protocols: str = "") -> None:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        if protocols:
            headers.append((b"sec-websocket-protocol", protocols.encode()))
        self.scope = {
            "type": "websocket",
            "path": "/v1/realtime",
            "headers": headers,
            "query_string": b"model=m",
            "subprotocols": [p.strip() for p in protocols.split(",") if p.strip()],
            "extensions": {"websocket.http.response": {}},
        }
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.inbox.put_nowait({"type": "websocket.connect"})
        self.sent: list[dict] = []
        self.arrived = asyncio.Event()
        self.task = asyncio.create_task(app(self.scope, self.inbox.get, self._send))

    async def _send(self, message: dict) -> None:
        self.sent.append(message)
        self.arrived.set()

    def send(self, event: dict) -> None:
        self.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(event)})

    def close(self) -> None:
        self.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})

    def events(self) -> list[dict]:
        return [json.loads(m["text"]) for m in self.sent if m["type"] == "websocket.send"]

    async def until(self, kind: str, count: int = 1) -> dict:
        while True:
            found = [e for e in self.events() if e["type"] == kind]
            if len(found) >= count:
                return found[count - 1]
            if self.task.done():
                raise AssertionError(f"the session ended without {kind}: {self.sent}")
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 10)

    def closed_with(self) -> int | None:
        return next((m.get("code") for m in self.sent if m["type"] == "websocket.close"), None)


def endpoint(**options) -> RealtimeEndpoint:
    return RealtimeEndpoint(FakeStub(), RealtimeOptions(**options), "m", KEYS.refusal)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_wrong_key_is_refused_with_401_before_the_handshake():
    async def scenario():
        app = endpoint()
        s = Socket(app, key="sk-wrong")
        await s.task
        return s.sent

    sent = run(scenario())
    assert sent[0]["type"] == "websocket.http.response.start" and sent[0]["status"] == 401
    assert not any(m["type"] == "websocket.accept" for m in sent)
    assert json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"


def test_the_key_in_the_browser_subprotocol_is_accepted():
    async def scenario():
        app = endpoint()
        s = Socket(app, key=None, protocols=f"realtime, openai-insecure-api-key.{KEY}")
        await s.until("session.created")
        s.close()
        await s.task
        return s.sent

    sent = run(scenario())
    assert sent[0] == {"type": "websocket.accept", "subprotocol": "realtime", "headers": []}


@pytest.mark.parametrize("limit", ["per_key", "total"])
def test_sessions_over_the_limits_are_told_why_and_closed_1013(limit):
    async def scenario():
        app = endpoint(max_sessions_per_key=1) if limit == "per_key" else endpoint(max_sessions=1)
        first = Socket(app)
        await first.until("session.created")
        second = Socket(app, key=KEY)
        await second.task
        other = Socket(app, key=OTHER)
        if limit == "per_key":
            await other.until("session.created")
        else:
            await other.task
        first.close()
        await first.task
        again = Socket(app, key=KEY)
        await again.until("session.created")
        again.close()
        other.close()
        await asyncio.gather(again.task, other.task)
        return second, other, app.slots.total

    second, other, left = run(scenario())
    error = second.events()[0]
    assert error["type"] == "error" and error["error"]["code"] == "session_limit_reached"
    key = "realtime_max_sessions_per_key" if limit == "per_key" else "realtime_max_sessions"
    assert key in error["error"]["message"] and second.closed_with() == 1013
    assert (other.closed_with() == 1013) == (limit == "total")
    assert left == 0


def test_an_idle_session_and_a_long_one_are_ended_with_1008():
    async def scenario():
        idle = Socket(endpoint(idle_timeout_s=0.2))
        await idle.task
        long = Socket(endpoint(max_session_s=0.3, idle_timeout_s=60))
        for _ in range(3):
            long.send({"type": "input_audio_buffer.clear"})
        await long.task
        return idle, long

    idle, long = run(scenario())
    assert idle.events()[-1]["error"]["code"] == "idle_timeout" and idle.closed_with() == 1008
    assert long.events()[-1]["error"]["code"] == "session_expired" and long.closed_with() == 1008


def test_the_audio_buffer_is_bounded_and_cleared_when_full():
    async def scenario():
        s = Socket(endpoint(max_buffer_bytes=9600))
        s.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await s.until("session.updated")
        ok = base64.b64encode(b"\x00\x01" * 2400).decode()
        too_much = base64.b64encode(b"\x00\x01" * 4800).decode()
        s.send({"type": "input_audio_buffer.append", "audio": ok, "event_id": "a1"})
        s.send({"type": "input_audio_buffer.append", "audio": too_much, "event_id": "a2"})
        full = await s.until("error")
        s.send({"type": "input_audio_buffer.commit", "event_id": "c1"})
        empty = await s.until("error", 2)
        s.close()
        await s.task
        return full, empty

    full, empty = run(scenario())
    assert (full["error"]["event_id"], full["error"]["code"]) == ("a2", "input_audio_buffer_full")
    assert "gateway.realtime_max_buffer_bytes" in full["error"]["message"]
    assert (empty["error"]["event_id"], empty["error"]["code"]) == ("c1", "input_audio_buffer_commit_empty")


def test_the_conversation_settings_are_fixed_once_it_has_begun_and_the_call_ends_with_the_socket():
    async def scenario():
        app = endpoint()
        s = Socket(app)
        s.send(
            {"type": "session.update", "session": {"instructions": "Be kind.", "output_modalities": ["text"]}}
        )
        s.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Hi"}],
                },
            }
        )
        s.send({"type": "response.create"})
        done = await s.until("response.done")
        s.send({"type": "session.update", "session": {"instructions": "Be rude."}, "event_id": "u2"})
        locked = await s.until("error")
        s.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await s.until("session.updated", 2)
        s.close()
        await s.task
        return app.stub.calls, done, locked

    calls, done, locked = run(scenario())
    (call,) = calls
    config = call.written[0].config
    assert config.system_prompt == "Be kind." and list(config.output_modalities) == [omni_pb2.MODALITY_TEXT]
    assert [m.WhichOneof("item") for m in call.written] == ["config", "text"]
    assert done["response"]["status"] == "completed"
    assert done["response"]["output"][0]["content"][0]["text"] == "Hi."
    assert (locked["error"]["event_id"], locked["error"]["code"]) == ("u2", "session_locked")
    assert call.cancelled  # the socket went: the Converse call was closed


def test_a_failed_conversation_fails_the_response_and_the_next_one_opens_a_new_call():
    class Refusing(FakeCall):
        async def read(self):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "config.voice: unknown",
            )

    async def scenario():
        app = endpoint()
        app.stub.Converse = lambda metadata=(), timeout=None: (
            app.stub.calls.append(Refusing()) or app.stub.calls[-1]
        )
        s = Socket(app)
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
        s.send({"type": "conversation.item.create", "item": item})
        s.send({"type": "response.create"})
        failed = await s.until("response.done")
        error = await s.until("error")
        s.send({"type": "conversation.item.create", "item": item})
        s.send({"type": "response.create"})
        await s.until("response.done", 2)
        s.close()
        await s.task
        return app, failed, error

    app, failed, error = run(scenario())
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["status_details"]["error"]["message"] == "config.voice: unknown"
    assert (error["error"]["type"], error["error"]["code"]) == ("invalid_request_error", "invalid_argument")
    assert len(app.stub.calls) == 2 and app.slots.total == 0


def test_server_vad_times_speech_on_the_session_clock_and_sends_the_turn_with_its_padding():
    async def scenario():
        app = endpoint()
        s = Socket(app)
        s.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
        for _ in range(10):  # 1 s before the detector changes
            s.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(silence(0.1)).decode()})
        turn_detection = {"type": "server_vad", "silence_duration_ms": 300, "prefix_padding_ms": 200}
        s.send(
            {"type": "session.update", "session": {"audio": {"input": {"turn_detection": turn_detection}}}}
        )
        said = utterance(0.8, 0.5, 0.8)
        for at in range(0, len(said), 4800):
            s.send(
                {
                    "type": "input_audio_buffer.append",
                    "audio": base64.b64encode(said[at : at + 4800]).decode(),
                }
            )
        started = await s.until("input_audio_buffer.speech_started")
        stopped = await s.until("input_audio_buffer.speech_stopped")
        done = await s.until("response.done")
        s.close()
        await s.task
        return app.stub.calls[0], started, stopped, done, s.events()

    call, started, stopped, done, events = run(scenario())
    assert 1500 - 64 <= started["audio_start_ms"] <= 1500 + 128  # 1 s + the utterance's 0.5 s lead
    assert 2300 - 192 <= stopped["audio_end_ms"] <= 2300 + 128
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert committed["item_id"] == started["item_id"] == stopped["item_id"]
    kinds = [m.WhichOneof("item") for m in call.written]
    assert kinds[0] == "config" and kinds[-1] == "end_of_turn" and set(kinds[1:-1]) == {"audio"}
    pcm = b"".join(m.audio.pcm16 for m in call.written[1:-1])
    assert {m.audio.sample_rate_hz for m in call.written[1:-1]} == {24000}
    # The turn: 200 ms of padding before the speech start, through the silence that ended it.
    assert len(pcm) // 48 >= 200 + (stopped["audio_end_ms"] - started["audio_start_ms"]) + 300 - 100
    assert done["response"]["status"] == "completed"


def test_an_event_of_too_many_json_values_is_refused_before_it_is_parsed():
    from omnistage.services.gateway.openai.app import MAX_JSON_VALUES

    async def scenario():
        s = Socket(endpoint())
        many = (
            '{"type": "session.update", "session": {"instructions": "x"}, "pad": ['
            + "0," * MAX_JSON_VALUES
            + "0]}"
        )
        s.inbox.put_nowait({"type": "websocket.receive", "text": many})
        refused = await s.until("error")
        s.send({"type": "session.update", "session": {"instructions": "ok"}})
        updated = await s.until("session.updated")
        s.close()
        await s.task
        return refused, updated

    refused, updated = run(scenario())
    assert refused["error"]["code"] == "invalid_event" and str(MAX_JSON_VALUES) in refused["error"]["message"]
    assert updated["session"]["instructions"] == "ok"


def test_an_error_that_is_not_a_disconnect_is_logged_and_the_session_goes_on(monkeypatch, caplog):
    """A RuntimeError of the gateway's own while a response streams (here: a bug in the response's
    event handling) fails that response with a server_error and is logged; the session, whose socket
    is still open, answers the next turn (on main any RuntimeError ended the session as "the client
    left")."""
    from omnistage.services.gateway.openai import realtime_response

    real = realtime_response.Response.on_event
    failures = iter([RuntimeError("a bug")])

    async def on_event(self, event):
        if event.HasField("text") and (exc := next(failures, None)) is not None:
            raise exc
        await real(self, event)

    monkeypatch.setattr(realtime_response.Response, "on_event", on_event)

    async def scenario():
        s = Socket(endpoint())
        s.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await s.until("session.updated")
        for n in (1, 2):
            s.send({"type": "conversation.item.create", "item": _text_item(f"Question {n}?")})
            s.send({"type": "response.create"})
            await s.until("response.done", n)
        s.close()
        await s.task
        return s

    with caplog.at_level("ERROR", logger="omnistage.services.gateway.openai.realtime"):
        s = run(scenario())
    first, second = [e["response"] for e in s.events() if e["type"] == "response.done"]
    assert first["status"] == "failed" and first["status_details"]["error"]["code"] == "server_error"
    assert second["status"] == "completed" and s.closed_with() is None
    assert any("failed on an event" in r.getMessage() for r in caplog.records)


def _text_item(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def test_an_utterance_past_the_turn_limit_is_dropped_whole_naming_the_limit_and_the_next_one_is_heard():
    """The encoder's longest clip binds here (1.5 s, under the buffer's bytes): the error names it and the
    limit (not the room left); the rest of the long utterance is no second turn."""

    async def scenario():
        options = RealtimeOptions().buffer_limit(10**9, max_audio_seconds=1.5)
        app = RealtimeEndpoint(FakeStub(), options, "m", KEYS.refusal)
        s = Socket(app)
        turn_detection = {"type": "server_vad", "silence_duration_ms": 300}
        s.send(
            {
                "type": "session.update",
                "session": {
                    "output_modalities": ["text"],
                    "audio": {"input": {"turn_detection": turn_detection}},
                },
            }
        )
        said = utterance(2.5, 0.3, 0.8) + utterance(0.6, 0.3, 0.8)  # too long, then one that fits
        for at in range(0, len(said), 4800):
            s.send(
                {
                    "type": "input_audio_buffer.append",
                    "audio": base64.b64encode(said[at : at + 4800]).decode(),
                }
            )
        full = await s.until("error")
        done = await s.until("response.done")
        s.close()
        await s.task
        return app.stub.calls[0], full, done, s.events()

    call, full, done, events = run(scenario())
    assert full["error"]["code"] == "input_audio_buffer_full"
    message = full["error"]["message"]
    assert "72000 bytes" in message and "1.5 s" in message and "encoder.max_audio_seconds" in message, message
    kinds = [e["type"] for e in events]
    assert kinds.count("input_audio_buffer.speech_started") == 2, kinds  # the long one once, the next once
    assert kinds.count("input_audio_buffer.speech_stopped") == 1 and kinds.count("error") == 1, kinds
    pcm = b"".join(m.audio.pcm16 for m in call.written if m.HasField("audio"))
    assert len(pcm) < 72000  # only the second utterance reached the conversation
    assert done["response"]["status"] == "completed"


class InterruptibleCall(FakeCall):
    """A Converse call whose answer keeps coming until the client cancels it; then the turn's Finish
    (INTERRUPTED, with the usage the conversation knows: the prompt's tokens)."""

    async def write(self, message: omni_pb2.ConverseRequest) -> None:
        self.written.append(message)
        if message.HasField("text"):
            turn, self.turns = self.turns, self.turns + 1
            for _ in range(3):
                await self.events.put(omni_pb2.GenerateEvent(turn=turn, text=omni_pb2.TextDelta(text="la ")))
        elif message.cancel:
            await self.events.put(
                omni_pb2.GenerateEvent(turn=self.turns - 1, text=omni_pb2.TextDelta(text="late"))
            )
            finish = omni_pb2.Finish(
                reason=common_pb2.FINISH_REASON_INTERRUPTED,
                usage=common_pb2.Usage(prompt_tokens=42, completion_tokens=4),
            )
            await self.events.put(omni_pb2.GenerateEvent(turn=self.turns - 1, finish=finish))


def test_a_cancelled_response_reports_the_turns_usage_and_no_delta_after_the_cancel():
    async def scenario():
        stub = FakeStub()
        stub.Converse = lambda metadata=(), timeout=None: (
            stub.calls.append(InterruptibleCall()) or stub.calls[-1]
        )
        app = RealtimeEndpoint(stub, RealtimeOptions(), "m", KEYS.refusal)
        s = Socket(app)
        s.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Sing."}]}
        s.send({"type": "conversation.item.create", "item": item})
        s.send({"type": "response.create"})
        await s.until("response.output_text.delta", 3)
        s.send({"type": "response.cancel"})
        done = await s.until("response.done")
        s.close()
        await s.task
        return done, s.events()

    done, events = run(scenario())
    response = done["response"]
    assert response["status"] == "cancelled"
    assert response["status_details"]["reason"] == "client_cancelled"
    assert response["usage"]["input_tokens"] == 42
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["la "] * 3


# ---- the Converse call opened ahead of the first turn (issue 38: the first turn no slower than the next)


def _traced(app: RealtimeEndpoint, s: Socket) -> None:
    """Each Converse call the session opens leaves a mark in `s.sent`, in order with what it sent."""
    opened = app.stub.Converse

    def converse(metadata=(), timeout=None):
        s.sent.append({"type": "converse.opened"})
        return opened(metadata=metadata, timeout=timeout)

    app.stub.Converse = converse


def _order(s: Socket) -> list[str]:
    return [json.loads(m["text"])["type"] if m["type"] == "websocket.send" else m["type"] for m in s.sent]


def _speak(s: Socket, said: bytes) -> None:
    for at in range(0, len(said), 4800):
        s.send(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(said[at : at + 4800]).decode()}
        )


@pytest.mark.parametrize("configured", [True, False], ids=["session.update", "no session.update"])
def test_the_first_turns_call_is_open_before_the_turn_ends(configured):
    """The Converse call is opened when the session is configured (else when speech starts), not by the
    first response: the turn's end finds it open, as every later turn's does, and the turns go on it."""

    async def scenario():
        app = endpoint()
        s = Socket(app)
        _traced(app, s)
        if configured:
            vad = {"type": "server_vad", "silence_duration_ms": 300}
            session = {"instructions": "Be kind.", "audio": {"input": {"turn_detection": vad}}}
            s.send({"type": "session.update", "session": session})
        _speak(s, utterance(0.6, 0.3, 0.8) + utterance(0.6, 0.3, 0.8))
        await s.until("response.done", 2)
        s.close()
        await s.task
        return app.stub.calls, _order(s)

    calls, order = run(scenario())
    (call,) = calls
    assert order.count("converse.opened") == 1
    opened = order.index("converse.opened")
    if configured:
        assert order.index("session.updated") < opened < order.index("input_audio_buffer.speech_started")
        assert call.written[0].config.system_prompt == "Be kind."
    else:
        assert order.index("input_audio_buffer.speech_started") < opened
    assert opened < order.index("input_audio_buffer.speech_stopped") < order.index("response.created")
    kinds = [m.WhichOneof("item") for m in call.written]
    assert kinds[0] == "config" and kinds.count("end_of_turn") == 2 and kinds.count("config") == 1


def test_a_session_update_before_the_first_response_replaces_the_prepared_call():
    """New instructions before any response: the call prepared with the old ones is cancelled (it
    carried nothing but its config) and one with the new ones carries the turn; an update that leaves
    the call's config alone (turn detection) keeps it; once a response began, a change is refused."""

    async def scenario():
        app = endpoint()
        s = Socket(app)
        _traced(app, s)
        s.send(
            {"type": "session.update", "session": {"instructions": "Be kind.", "output_modalities": ["text"]}}
        )
        s.send({"type": "session.update", "session": {"instructions": "Be brief."}})
        s.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        s.send({"type": "conversation.item.create", "item": _text_item("Hi")})
        s.send({"type": "response.create"})
        done = await s.until("response.done")
        s.send({"type": "session.update", "session": {"instructions": "Be rude."}, "event_id": "u4"})
        locked = await s.until("error")
        s.close()
        await s.task
        return app.stub.calls, done, locked, _order(s)

    calls, done, locked, order = run(scenario())
    old, new = calls
    assert [m.WhichOneof("item") for m in old.written] == ["config"] and old.cancelled
    assert old.written[0].config.system_prompt == "Be kind."
    assert new.written[0].config.system_prompt == "Be brief."
    assert list(new.written[0].config.output_modalities) == [omni_pb2.MODALITY_TEXT]
    assert [m.WhichOneof("item") for m in new.written] == ["config", "text"]
    assert order.count("converse.opened") == 2 and order.count("session.updated") == 3
    assert done["response"]["status"] == "completed"
    assert (locked["error"]["event_id"], locked["error"]["code"]) == ("u4", "session_locked")


def test_a_prepared_call_that_fails_before_any_response_is_not_reported_and_the_response_opens_one():
    class Refusing(FakeCall):
        refused = False

        async def read(self):
            self.refused = True
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "gateway full"
            )

    async def scenario():
        app = endpoint()
        made = iter([Refusing()])
        app.stub.Converse = lambda metadata=(), timeout=None: (
            app.stub.calls.append(next(made, None) or FakeCall()) or app.stub.calls[-1]
        )
        s = Socket(app)
        s.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
        await s.until("session.updated")
        await asyncio.wait_for(_until(lambda: app.stub.calls and app.stub.calls[0].refused), 10)
        s.send({"type": "conversation.item.create", "item": _text_item("Hi")})
        s.send({"type": "response.create"})
        done = await s.until("response.done")
        s.close()
        await s.task
        return app.stub.calls, done, s.events()

    calls, done, events = run(scenario())
    assert len(calls) == 2 and calls[0].written[0].HasField("config")
    assert [m.WhichOneof("item") for m in calls[1].written] == ["config", "text"]
    assert done["response"]["status"] == "completed"
    assert not [e for e in events if e["type"] == "error"]  # no response needed the call that failed


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)
