"""Stage replicas over real gRPC: calls go to the least loaded replica that is up (in turn when equal,
by share of capacity otherwise); a replica that stops answering fails its calls with UNAVAILABLE naming
it while the others serve, and is put back when it answers again; admission counts the capacity of the
replicas that are up; a spoken answer takes the least loaded talker with a credit, and one that gets
no stream in time, or finds every talker down, is text only with an audio status saying why."""

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
from omnistage.services.gateway.outputs.image_options import ImageLimits
from omnistage.services.gateway.outputs.imagegen import ImageStage
from omnistage.services.gateway.outputs.talker import SpeechLimits, SpeechStage
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.stage_watch import StageWatch
from omnistage.services.gateway.stages import ImageGenClient, TalkerClient
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import imagegen_pb2, imagegen_pb2_grpc, omni_pb2, talker_pb2, talker_pb2_grpc

from tests.services.gateway.gateway_speech_fakes import Context, FakeThinker, wait_until

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


def _spoken(i: int) -> omni_pb2.GenerateRequest:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Hi")])
    outputs = [omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO]
    return omni_pb2.GenerateRequest(request_id=f"s{i}", messages=[msg], output_modalities=outputs)


def test_speech_takes_the_least_loaded_talker_and_a_full_or_down_talker_leaves_the_text_whole():
    async def main():
        async with _replicas(
            ("talker", "talker_b"), HeldTalker, talker_pb2_grpc.add_TalkerServicer_to_server, TalkerClient
        ) as reps:
            (t1, _, _), (t2, _, _) = reps
            t1.max_streams = t2.max_streams = 1
            # A stream is waited for at most stream_wait_s: then the answer is text only.
            limits = SpeechLimits(1000, start_wait_s=1.0, idle_timeout_s=0.5, stream_wait_s=0.2)
            stage = SpeechStage([t1, t2], limits, "test")
            pipeline = Pipeline(
                FakeThinker("Hello there. "),
                {"thinker", "talker"},
                max_concurrent_requests=8,
                limits=RequestLimits(),
                system_prompt="",
                speech=stage,
            )
            servicer = OmniServicer(pipeline)

            async def collect(i: int) -> list:
                return [e async for e in servicer.Generate(_spoken(i), Context())]

            held = [asyncio.create_task(collect(i)) for i in range(2)]
            await wait_until(lambda: (t1.calls_in_flight, t2.calls_in_flight) == (1, 1), what="one on each")
            full = await collect(2)
            spoken = await asyncio.gather(*held)  # the held talkers go silent: given up after idle_timeout_s
            again = await collect(3)  # the streams are free again
            t1.down_reason = t2.down_reason = "stopped answering: test"
            down = await collect(4)
            return full, spoken, again, down, pipeline.admission.gates["talker"]

    full, spoken, again, down, gate = asyncio.run(asyncio.wait_for(main(), 60))
    for events in (full, *spoken, again, down):
        assert "".join(e.text.text for e in events if e.HasField("text")) == "Hello there. "
    status = full[-1].finish.audio
    assert (status.outcome, status.code) == (omni_pb2.AUDIO_OUTCOME_NONE, "RESOURCE_EXHAUSTED")
    assert "within 0.2s" in status.message and status.retry_after_ms > 0
    assert [s[-1].finish.audio.code for s in spoken] == ["DEADLINE_EXCEEDED"] * 2
    assert again[-1].finish.audio.code == "DEADLINE_EXCEEDED"  # it got a stream (held, then silent)
    status = down[-1].finish.audio
    assert status.code == "UNAVAILABLE" and "'talker_b'" in status.message
    assert (gate.running, gate.waiting) == (0, 0)


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
