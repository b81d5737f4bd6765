"""StageWatch over real gRPC: a stage that hangs or stops SERVING is marked down, the calls in flight
on it fail at once with UNAVAILABLE naming the stage, and it is re-admitted when it serves again."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import GatewayConfig
from omnistage.common.runtime.errors import StageUnavailable
from omnistage.services.gateway.stage_watch import StageWatch
from omnistage.services.gateway.stages import ThinkerClient
from omnistage.v1 import common_pb2, thinker_pb2, thinker_pb2_grpc

FAST = GatewayConfig(stage_health_interval_s=0.05, stage_health_timeout_s=0.3, stage_health_failures=2)


class Health(health_pb2_grpc.HealthServicer):
    """SERVING / NOT_SERVING on demand, or no answer at all (a stopped process)."""

    def __init__(self) -> None:
        self.status = health_pb2.HealthCheckResponse.SERVING
        self.hung = asyncio.Event()

    async def Check(self, request, context):
        if self.hung.is_set():
            await asyncio.sleep(3600)
        return health_pb2.HealthCheckResponse(status=self.status)


class SlowThinker(thinker_pb2_grpc.ThinkerServicer):
    """`started`, then a delta every 50 ms for a minute."""

    async def Generate(self, request, context):
        yield thinker_pb2.ThinkerEvent(started=thinker_pb2.Started(engine_request_id="e" * 32))
        for i in range(1200):
            await asyncio.sleep(0.05)
            yield thinker_pb2.ThinkerEvent(delta=thinker_pb2.TokenDelta(token_ids=[i], text="x"))


async def _stage():
    server, health = grpc.aio.server(), Health()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    thinker_pb2_grpc.add_ThinkerServicer_to_server(SlowThinker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, health, ThinkerClient("thinker", f"127.0.0.1:{port}", 1 << 20)


async def _stream(client: ThinkerClient, seen: asyncio.Event) -> None:
    prompt = thinker_pb2.ChatPrompt(pieces=[thinker_pb2.PromptPiece(text="hi")])
    async for _ in client.generate("r", prompt, common_pb2.SamplingParams(max_tokens=10), 60.0):
        seen.set()


@pytest.mark.parametrize("fault", ["hang", "not-serving"])
def test_a_stage_that_stops_answering_fails_its_calls_naming_it_and_comes_back(fault):
    async def main():
        server, health, client = await _stage()
        ups = []
        watch = StageWatch(client, FAST, on_up=lambda: _record(ups))
        assert not client.up and "starting" in client.down_reason
        with pytest.raises(StageUnavailable, match="stage 'thinker' is unavailable: starting"):
            await _stream(client, asyncio.Event())
        watch.start()
        try:
            assert await watch.wait_admitted(5.0) and client.up and len(ups) == 1
            seen = asyncio.Event()
            call = asyncio.create_task(_stream(client, seen))
            await asyncio.wait_for(seen.wait(), 5.0)
            if fault == "hang":
                health.hung.set()
            else:
                health.status = health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(StageUnavailable) as lost:
                await asyncio.wait_for(call, 10.0)  # not the 60 s deadline of the call
            assert lost.value.code == grpc.StatusCode.UNAVAILABLE
            assert "stage 'thinker' is unavailable: stopped answering" in str(lost.value)
            assert not client.up and client.calls_in_flight == 0 and watch.times_lost == 1
            health.hung.clear()
            health.status = health_pb2.HealthCheckResponse.SERVING
            assert await watch.wait_admitted(10.0) and len(ups) == 2  # re-admitted after its on_up step
        finally:
            await watch.stop()
            await client.close()
            await server.stop(0)

    asyncio.run(main())


def test_a_stage_whose_warm_up_fails_stays_out_and_says_why():
    async def main():
        server, _, client = await _stage()

        async def failing():
            raise RuntimeError("no audio in the warm-up sentence")

        watch = StageWatch(client, FAST, on_up=failing)
        watch.start()
        try:
            assert not await watch.wait_admitted(0.5)
            assert client.down_reason == "warm-up failed: RuntimeError: no audio in the warm-up sentence"
        finally:
            await watch.stop()
            await client.close()
            await server.stop(0)

    asyncio.run(main())


async def _record(ups: list) -> None:
    ups.append(True)


def test_a_stage_turning_serving_is_admitted_as_it_happens_not_at_the_next_poll():
    """Health.Watch: with an hour between polls, a stage that turns SERVING is still admitted now."""

    async def main():
        from grpc_health.v1 import health

        server, checker = grpc.aio.server(), health.aio.HealthServicer()
        await checker.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = ThinkerClient("thinker", f"127.0.0.1:{port}", 1 << 20)
        ups = []
        slow = GatewayConfig(stage_health_interval_s=3600, stage_health_timeout_s=5, stage_health_failures=2)
        watch = StageWatch(client, slow, on_up=lambda: _record(ups))
        watch.start()
        try:
            assert (
                not await watch.wait_admitted(0.5) and "starting" in client.down_reason
            )  # the first poll said no
            await checker.set("", health_pb2.HealthCheckResponse.SERVING)
            assert await watch.wait_admitted(30.0), client.down_reason
            assert client.up and len(ups) == 1
        finally:
            await watch.stop()
            await client.close()
            await server.stop(0)

    asyncio.run(main())
