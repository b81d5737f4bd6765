"""Stage replicas over real gRPC: calls go to the least loaded replica that is up (in turn when equal,
by share of capacity otherwise); a replica that stops answering fails its calls with UNAVAILABLE naming
it while the others serve, and is put back when it answers again; admission counts the capacity of the
replicas that are up; a spoken answer takes the least loaded talker with a credit, and is refused
naming every full one."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import GatewayConfig, ImageGenConfig
from omnistage.common.runtime.errors import StageUnavailable
from omnistage.common.transport import TransportContext
from omnistage.services.gateway.admission import GateConfig, StageGate
from omnistage.services.gateway.imaging import ImageLimits, ImageStage
from omnistage.services.gateway.speech import SpeechLimits, SpeechStage, TalkerStream, VoiceChoice
from omnistage.services.gateway.stage_watch import StageWatch
from omnistage.services.gateway.stages import ImageGenClient, TalkerClient
from omnistage.v1 import imagegen_pb2, imagegen_pb2_grpc, talker_pb2, talker_pb2_grpc

FAST = GatewayConfig(stage_health_interval_s=0.05, stage_health_timeout_s=0.3, stage_health_failures=2)


class Health(health_pb2_grpc.HealthServicer):
    """SERVING, or no answer at all while `hung` (a stopped process)."""

    def __init__(self) -> None:
        self.hung = asyncio.Event()

    async def Check(self, request, context):
        if self.hung.is_set():
            await asyncio.sleep(3600)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class HeldImageGen(imagegen_pb2_grpc.ImageGenServicer):
    """A progress event at once, the image when `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.requests: list[str] = []

    async def Generate(self, request, context):
        self.requests.append(request.request_id)
        yield imagegen_pb2.ImageGenEvent(progress=imagegen_pb2.ImageGenProgress(step=1, total_steps=2))
        await self.release.wait()
        yield imagegen_pb2.ImageGenEvent(image=imagegen_pb2.ImageGenImage(png=b"png", width=64, height=64))


class HeldTalker(talker_pb2_grpc.TalkerServicer):
    """Accepts a Speak call and holds it open."""

    async def Speak(self, requests, context):
        first = await anext(aiter(requests))
        yield talker_pb2.SpeakResponse(
            started=talker_pb2.SpeakStarted(
                request_id=first.config.request_id, sample_rate_hz=44100, channels=1
            )
        )
        await asyncio.sleep(3600)


@contextlib.asynccontextmanager
async def _replicas(names, servicer_cls, add, client_cls):
    """One gRPC server per replica (health + the stage API) and its client, all up."""
    servers, out = [], []
    for name in names:
        server, health, servicer = grpc.aio.server(), Health(), servicer_cls()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        add(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = client_cls(name, f"127.0.0.1:{port}", 1 << 20)
        client.down_reason = ""
        servers.append(server)
        out.append((client, health, servicer))
    try:
        yield out
    finally:
        for client, *_ in out:
            await client.close()
        for server in servers:
            await server.stop(None)


@contextlib.asynccontextmanager
async def _two_image_replicas():
    """An ImageStage over replicas `imagegen` and `imagegen_b`: (stage, [(client, health, servicer)] x 2)."""
    async with _replicas(
        ("imagegen", "imagegen_b"),
        HeldImageGen,
        imagegen_pb2_grpc.add_ImageGenServicer_to_server,
        ImageGenClient,
    ) as reps:
        stage = ImageStage(
            [c for c, _, _ in reps],
            TransportContext(),
            ImageLimits.of(ImageGenConfig(), None),
            service="test",
        )
        yield stage, reps


async def _open(stage: ImageStage, request_id: str) -> tuple[str, asyncio.Task]:
    """A call on the replica the stage picks, open (its first event read); (replica, task to its image)."""
    client = stage.replica_for(request_id)
    request = imagegen_pb2.ImageGenRequest(request_id=request_id)
    events = client.generate(request, 30.0)
    first = await anext(events)
    assert first.WhichOneof("event") == "progress"

    async def rest() -> str:
        async for ev in events:
            if ev.WhichOneof("event") == "image":
                return client.name
        return ""

    return client.name, asyncio.create_task(rest())


def test_calls_go_to_the_least_loaded_replica_by_share_of_capacity():
    async def main():
        async with _two_image_replicas() as (stage, reps):
            (a, _, sa), (b, _, sb) = reps
            a.max_running = b.max_running = 2
            picks = [await _open(stage, f"even-{i}") for i in range(4)]
            assert [name for name, _ in picks] == ["imagegen", "imagegen_b", "imagegen", "imagegen_b"]
            assert (a.calls_in_flight, b.calls_in_flight) == (2, 2)
            sa.release.set()
            sb.release.set()
            assert sorted([await t for _, t in picks]) == ["imagegen", "imagegen", "imagegen_b", "imagegen_b"]
            sa.release.clear()
            sb.release.clear()
            a.max_running, b.max_running = 1, 3  # b takes three times a's load
            picks = [await _open(stage, f"share-{i}") for i in range(4)]
            assert sorted(name for name, _ in picks) == ["imagegen", "imagegen_b", "imagegen_b", "imagegen_b"]
            assert (a.calls_in_flight, b.calls_in_flight) == (1, 3)
            sa.release.set()
            sb.release.set()
            await asyncio.gather(*(t for _, t in picks))

    asyncio.run(main())


def test_a_replica_that_stops_answering_fails_its_calls_naming_it_while_the_other_serves():
    async def main():
        async with _two_image_replicas() as (stage, reps):
            (a, _, sa), (b, hb, sb) = reps
            a.max_running = b.max_running = 4
            watches = [StageWatch(c, FAST) for c in (a, b)]
            for w in watches:
                w.start()
            try:
                assert all([await w.wait_admitted(5.0) for w in watches])
                on_a, task_a = await _open(stage, "r0")
                on_b, task_b = await _open(stage, "r1")
                assert (on_a, on_b) == ("imagegen", "imagegen_b")
                hb.hung.set()  # imagegen_b stops answering (SIGSTOP): its call fails, naming it
                with pytest.raises(StageUnavailable) as lost:
                    await asyncio.wait_for(task_b, 10.0)
                assert lost.value.code == grpc.StatusCode.UNAVAILABLE
                assert "stage 'imagegen_b' is unavailable: stopped answering" in str(lost.value)
                # the other replica keeps serving, and takes every new call though it is the busier one
                assert [(await _open(stage, f"after-{i}"))[0] for i in range(3)] == ["imagegen"] * 3
                assert a.calls_in_flight == 4 and not task_a.done()
                sa.release.set()
                assert await asyncio.wait_for(task_a, 10.0) == "imagegen"
                hb.hung.clear()  # it answers again: admitted again, and the least loaded replica
                for _ in range(200):
                    if b.up:
                        break
                    await asyncio.sleep(0.05)
                assert b.up and watches[1].times_admitted == 2 and watches[1].times_lost == 1
                name, task = await _open(stage, "back")
                assert name == "imagegen_b"
                sb.release.set()
                assert await asyncio.wait_for(task, 10.0) == "imagegen_b"
                a.down_reason = b.down_reason = "stopped answering: test"
                with pytest.raises(
                    StageUnavailable,
                    match="stage imagegen is unavailable: no replica can take "
                    "the call \\('imagegen': stopped answering: test; "
                    "'imagegen_b': stopped answering: test\\)",
                ):
                    stage.replica_for("none")
            finally:
                for w in watches:
                    await w.stop()

    asyncio.run(main())


def test_admission_counts_the_capacity_of_the_replicas_that_are_up():
    async def main():
        async with _two_image_replicas() as (stage, reps):
            (a, _, _), (b, _, _) = reps
            first = stage.capacity()  # nothing read yet: the deploy file's limits for the one stage
            assert first == (stage.limits.gate().max_running, stage.limits.gate().max_waiting)
            a.max_running, a.max_waiting = 2, 4
            b.max_running, b.max_waiting = 3, 6
            assert stage.capacity() == (5, 10)
            gate = StageGate("imagegen", GateConfig(), "test")
            gate.set_capacity(*stage.capacity())
            held = [gate.slot(60.0) for _ in range(5)]
            for slot in held:
                await slot.__aenter__()
            assert gate.running == 5 and not gate.has_room()  # five slots: both replicas' together
            b.down_reason = "stopped answering: test"
            assert stage.capacity() == (2, 4)
            a.down_reason = "stopped answering: test"
            assert stage.capacity() == (2, 4)  # none up: the last known replica's (calls fail UNAVAILABLE)
            for slot in held:
                await slot.__aexit__(None, None, None)

    asyncio.run(main())


def test_speech_takes_the_least_loaded_talker_with_a_credit_and_names_every_full_one():
    async def main():
        async with _replicas(
            ("talker", "talker_b"), HeldTalker, talker_pb2_grpc.add_TalkerServicer_to_server, TalkerClient
        ) as reps:
            (t1, _, _), (t2, _, _) = reps
            t1.max_streams = t2.max_streams = 1
            # A credit is waited for at most start_wait_s: then the speech is refused naming every full one.
            stage = SpeechStage([t1, t2], SpeechLimits(1000, start_wait_s=0.1), "test")
            streams = [TalkerStream(stage, f"s{i}", VoiceChoice(), 30.0, "") for i in range(3)]
            assert await streams[0].start() and await streams[1].start()
            assert (streams[0].talker.name, streams[1].talker.name) == ("talker", "talker_b")
            assert (t1.calls_in_flight, t2.calls_in_flight) == (1, 1)
            assert not await streams[2].start()
            status = streams[2].status
            assert status.code == "RESOURCE_EXHAUSTED"
            assert (
                status.message == "talker: all 1 streams are speaking, talker_b: all 1 streams are speaking"
            )
            streams[0].call.cancel()
            await asyncio.sleep(0.1)
            again = TalkerStream(stage, "s3", VoiceChoice(), 30.0, "")
            assert await again.start() and again.talker.name == "talker"  # the freed credit
            t1.down_reason = t2.down_reason = "stopped answering: test"
            down = TalkerStream(stage, "s4", VoiceChoice(), 30.0, "")
            assert (
                not await down.start()
                and down.status.code == "UNAVAILABLE"
                and "'talker_b'" in down.status.message
            )
            for s in (streams[1], again):
                s.call.cancel()

    asyncio.run(main())


def test_a_replica_a_call_finds_unreachable_is_taken_out_and_the_request_goes_to_another(tmp_path):
    """Killed before its watch's health checks noticed: the call's UNAVAILABLE takes it out at once, and
    the request, which it never began, denoises on the other replica (its condition forwarded there)."""
    from omnistage.common.transport import TransportOptions
    from omnistage.services.gateway.replicas import Replicas

    from tests.services.gateway.test_gateway_imaging import (
        FakeImageGen,
        FakeThinker,
        Gateway,
        free_port,
        kinds,
        leases,
        request,
    )

    async def main():
        producer = TransportContext(TransportOptions(shm_threshold_bytes=0, shm_pool_bytes=1 << 20))
        try:
            async with Gateway(FakeThinker(producer), FakeImageGen(), tmp_path) as gw:
                dead = ImageGenClient("imagegen_dead", f"127.0.0.1:{free_port()}", 4 << 20)
                never_checks = GatewayConfig(
                    stage_health_interval_s=60.0, stage_health_timeout_s=1.0, stage_health_failures=5
                )
                watch = StageWatch(dead, never_checks)
                dead.down_reason = gw.client.down_reason = ""
                gw.images.replicas = Replicas(
                    "imagegen", [dead, gw.client], "test"
                )  # the dead one first in turn
                events = await gw.events(request(steps=2))
                assert kinds(events)[-2:] == ["image", "finish"] and len(gw.imagegen.requests) == 1
                assert not dead.up and dead.down_reason.startswith(
                    "stopped answering: a call found it unreachable"
                )
                assert watch.times_lost == 1 and gw.client.up and leases(producer) == 0
                events = await gw.events(request(steps=1))  # the next one goes straight to the live replica
                assert kinds(events)[-1] == "finish" and len(gw.imagegen.requests) == 2
                await dead.close()
        finally:
            producer.close()

    asyncio.run(main())
