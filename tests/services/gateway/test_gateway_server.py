"""OmniServicer: the client's request_id in every event, the thinker's `started` kept inside."""

from __future__ import annotations

import asyncio

import grpc
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.stages import StageError
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import common_pb2, omni_pb2, thinker_pb2


class FakeThinker:
    """Streams started, two deltas and a finish; remembers what it was asked."""

    def __init__(self) -> None:
        self.calls = []

    def error(self, exc: grpc.aio.AioRpcError) -> StageError:  # as ThinkerClient.error of a stage that is up
        return StageError("thinker", exc)

    async def generate(self, request_id, prompt, sampling, timeout_s, multimodal=None):
        self.calls.append((request_id, prompt))
        yield thinker_pb2.ThinkerEvent(started=thinker_pb2.Started(engine_request_id="e" * 32))
        for text in ("Hel", "lo"):
            yield thinker_pb2.ThinkerEvent(delta=thinker_pb2.TokenDelta(token_ids=[1], text=text))
        yield thinker_pb2.ThinkerEvent(finish=thinker_pb2.ThinkerFinish(reason=common_pb2.FINISH_REASON_STOP))


class Context:
    def time_remaining(self):
        return None


def generate(servicer, request_id: str) -> list[omni_pb2.GenerateEvent]:
    request = omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Hi")])],
    )

    async def collect():
        return [e async for e in servicer.Generate(request, Context())]

    return asyncio.run(collect())


def servicer(thinker: FakeThinker) -> OmniServicer:
    return OmniServicer(
        Pipeline(thinker, {"thinker"}, max_concurrent_requests=4, limits=RequestLimits(), system_prompt="")
    )


def test_every_event_carries_the_clients_id_and_started_stays_inside():
    thinker = FakeThinker()
    events = generate(servicer(thinker), "my-id")
    assert [e.WhichOneof("event") for e in events] == ["text", "text", "finish"]
    assert {e.request_id for e in events} == {"my-id"}
    assert thinker.calls[0][0] == "my-id"  # passed on for the thinker's logs only


def test_an_empty_id_gets_one_made_for_it():
    events = generate(servicer(FakeThinker()), "")
    ids = {e.request_id for e in events}
    assert len(ids) == 1 and len(ids.pop()) == 32
