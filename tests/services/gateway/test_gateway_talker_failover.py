"""Talker replicas fail over (issue 30, point 3; issue 43, point 6): two fake talkers over real gRPC, each
watched as the gateway watches its stages; under 8 spoken clients each replica is killed in turn (its
server stopped under its calls) and brought back. The `talker` gate counts the streams of the replicas
that are up, a replica that is down leaves the path without removing the gate, the answers it was
speaking go on on the other replica, and every spoken answer asked for while one replica is down waits
for a stream on the other and is spoken there. (The order of what happens when a replica is lost:
test_gateway_talker_moves.py.)"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common import metrics
from omnistage.common.config import GatewayConfig
from omnistage.services.gateway.outputs.talker import SpeechLimits, SpeechStage
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.stage_watch import StageWatch
from omnistage.services.gateway.stages import TalkerClient
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import common_pb2, omni_pb2, talker_pb2_grpc

from tests.services.gateway.gateway_speech_fakes import Context, FakeTalker, FakeThinker, wait_until

FAST = GatewayConfig(stage_health_interval_s=0.05, stage_health_timeout_s=0.3, stage_health_failures=2)
STREAMS = 2  # each replica's stress-tested streams (its Describe)
CLIENTS = 8


class Health(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Watch(self, request, context):  # the watch polls Check alone
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Watch")


class Replica:
    """One talker process: a FakeTalker with health on a fixed port, that can be killed and restarted."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.talker = FakeTalker(chunks_per_text=2)
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.talker = FakeTalker(chunks_per_text=2)  # a restarted process: a fresh talker
        self.server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(Health(), self.server)
        talker_pb2_grpc.add_TalkerServicer_to_server(self.talker, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    async def kill(self) -> None:
        """SIGKILL as its clients see it: the connection goes, its calls fail."""
        await self.server.stop(None)


async def _speak(servicer: OmniServicer, i: int) -> omni_pb2.AudioStatus:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=f"Question {i}?")])
    request = omni_pb2.GenerateRequest(
        request_id=f"r{i}",
        messages=[msg],
        output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
        sampling=common_pb2.SamplingParams(max_tokens=32),
    )
    events = [e async for e in servicer.Generate(request, Context(60.0))]
    assert events[-1].HasField("finish")
    return events[-1].finish.audio


@contextlib.asynccontextmanager
async def _gateway():
    replicas = [Replica("talker"), Replica("talker_b")]
    for r in replicas:
        await r.start()
    clients = [TalkerClient(r.name, f"127.0.0.1:{r.port}", 1 << 22) for r in replicas]
    for c in clients:
        c.max_streams = STREAMS
    speech = SpeechStage(clients, SpeechLimits(start_wait_s=10.0, idle_timeout_s=10.0), "gw-test")
    pipeline = Pipeline(
        FakeThinker("One two three four five six. ", delay_s=0.01),
        {"thinker", "talker"},
        max_concurrent_requests=64,
        limits=RequestLimits(),
        system_prompt="",
        speech=speech,
    )
    # As the gateway's stage watches do (gateway/startup.py): the gates follow every change.
    watches = [StageWatch(c, FAST, on_change=lambda _c: pipeline.stages_changed()) for c in clients]
    for w in watches:
        w.start()
    try:
        for w in watches:
            assert await w.wait_admitted(10.0)
        yield OmniServicer(pipeline), replicas, clients
    finally:
        for w in watches:
            await w.stop()
        for c in clients:
            await c.close()
        for r in replicas:
            await r.server.stop(None)


async def _kill_under_load(servicer, replicas, clients, victim: int) -> tuple[list, list, int]:
    """8 spoken clients; `victim` is killed while it speaks; then 8 more answers are asked for. Returns
    (statuses of the answers in flight at the kill, of those asked for while it was down, the gate's
    capacity while it was down, the answers whose speech moved from it)."""
    dead, live = replicas[victim], replicas[1 - victim]
    moved = _moves(dead.name)
    before = [asyncio.create_task(_speak(servicer, i)) for i in range(CLIENTS)]
    await wait_until(lambda: dead.talker.active > 0, what=f"{dead.name} speaking")
    await dead.kill()
    await wait_until(lambda: not clients[victim].up, what=f"{dead.name} marked down")
    capacity = servicer.pipeline.admission.gates["talker"].cfg.max_running
    during = [asyncio.create_task(_speak(servicer, 100 + i)) for i in range(CLIENTS)]
    statuses_during = await asyncio.gather(*during)
    statuses_before = await asyncio.gather(*before)
    assert live.talker.most_active <= STREAMS  # the live replica was never asked for more than it has
    await dead.start()  # the launcher restarts it: admitted again by its watch
    await wait_until(lambda: clients[victim].up, what=f"{dead.name} admitted again")
    await wait_until(
        lambda: servicer.pipeline.admission.gates["talker"].cfg.max_running == 2 * STREAMS, what="gate"
    )
    return statuses_before, statuses_during, capacity, _moves(dead.name) - moved


def _moves(replica: str) -> float:
    sample = metrics.REGISTRY.get_sample_value(
        "omnistage_gateway_speech_moves_total", {"service": "gw-test", "replica": replica}
    )
    return sample or 0.0


def test_each_talker_replica_killed_under_load_in_turn_fails_over_to_the_other():
    async def scenario():
        async with _gateway() as (servicer, replicas, clients):
            gate = servicer.pipeline.admission.gates["talker"]
            assert gate.cfg.max_running == 2 * STREAMS  # both replicas' streams together
            results = []
            for victim in (0, 1):
                results.append(await _kill_under_load(servicer, replicas, clients, victim))
            return results, gate.running, gate.waiting

    results, running, waiting = asyncio.run(asyncio.wait_for(scenario(), 120))
    for before, during, capacity, moved in results:
        assert capacity == STREAMS  # the dead replica's streams left the gate, the gate stayed
        # Every answer was spoken whole: those it was speaking went on on the other replica, those asked
        # for while it was down were spoken there.
        assert [s.outcome for s in before + during] == [omni_pb2.AUDIO_OUTCOME_COMPLETE] * 2 * CLIENTS, [
            (s.code, s.message) for s in before + during
        ]
        assert moved >= 1  # it was speaking when killed
    assert (running, waiting) == (0, 0)  # every slot came back
