"""Stage replicas under `omnistage serve`: deploy/local-tiny-replicas.yaml's shape (thinker, two talkers,
two image stages, gateway; no encoder) from the tiny config-only checkpoint with `load_format: dummy`
(every stage builds random weights). Image and speech calls are spread over both replicas of each;
an image replica killed (SIGKILL) under load fails only the requests it was denoising, with UNAVAILABLE
naming it, while the other replica serves every request that arrives meanwhile; the launcher restarts
it, the gateway admits it again, and new requests reach it again. A talker replica killed while both
speak moves its answers' speech to the other (from the segment not spoken yet): every answer in flight
and every one asked for after the kill is spoken to its end."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
from omnistage.common.checkpoint.config_only import write_config_checkpoint
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

from tests.e2e.serve_pipeline import ServeProcess, capabilities_ready, free_ports, metric
from tests.waits import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPLICAS = ("talker", "talker_b", "imagegen", "imagegen_b")


class Pipeline(ServeProcess):
    def __init__(self, root: Path) -> None:
        ckpt = write_config_checkpoint(root / "ckpt", "tiny")
        ports = iter(free_ports(20))
        svc = {
            name: {
                "kind": name.removesuffix("_b"),
                "port": next(ports),
                "admin_port": next(ports),
                "metrics_port": next(ports),
                "drain_grace_s": 1.0,
            }
            for name in ("thinker", *REPLICAS, "gateway")
        }
        svc["thinker"].update(
            dist_port=next(ports),
            engine={"max_num_seqs": 8, "max_num_batched_tokens": 128, "max_model_len": 512},
        )
        for name in ("talker", "talker_b"):
            svc[name]["talker"] = {
                "stress_batch_sizes": [2, 1],
                "max_segment_seconds": 8,
                "max_lm_tokens": 512,
            }
        for name in ("imagegen", "imagegen_b"):
            svc[name]["imagegen"] = {
                "highres": 512,
                "max_side_px": 512,
                "default_side_px": 256,
                "default_steps": 2,
                "max_steps": 100,
                "stress_batch_sizes": [2, 1],
            }
        svc["gateway"]["gateway"] = {
            "stage_health_interval_s": 0.5,
            "stage_health_timeout_s": 1.0,
            "stage_health_failures": 3,
            # Spoken answers wait for a stream of the live talker (moved ones too) rather than end
            # without audio: on a loaded CI host one talker's answers take seconds each.
            "talker_stream_wait_s": 120.0,
        }
        cfg = {
            "model": {"checkpoint": str(ckpt), "load_format": "dummy"},
            "startup": {"stop_grace_s": 5.0},
            "supervision": {"heartbeat_timeout_s": 10.0, "health_interval_s": 0.5, "backoff_initial_s": 1.0},
            "services": svc,
        }
        super().__init__(root, cfg)
        self.svc = svc
        self.gateway = f"127.0.0.1:{svc['gateway']['port']}"

    def calls(self, name: str, method: str) -> float:
        url = f"http://127.0.0.1:{self.svc[name]['metrics_port']}/metrics"
        return metric(url, f'omnistage_rpc_requests_total{{code="OK",method="{method}"', default=0.0)

    def denoising(self, replica: str) -> float:
        """Requests in a replica's own denoising loop (its omnistage_imagegen_active_requests): past the
        thinker's hidden states, on that replica for sure (the gateway's in-flight count starts at the
        replica's choice, before the call)."""
        url = f"http://127.0.0.1:{self.svc[replica]['metrics_port']}/metrics"
        return metric(url, "omnistage_imagegen_active_requests{", default=0.0)

    def streams(self, replica: str) -> float:
        """Speak streams a talker replica holds now (its omnistage_talker_streams)."""
        url = f"http://127.0.0.1:{self.svc[replica]['metrics_port']}/metrics"
        return metric(url, "omnistage_talker_streams{", default=0.0)

    def pid(self, name: str) -> int:
        return int(re.findall(rf"omnistage: started {name} r0 \(pid (\d+)\)", self.out.read_text())[-1])


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    p = Pipeline(tmp_path_factory.mktemp("replicas"))
    p.wait_ready(300.0)
    # ready = every capability; wait for every replica too
    wait_for(
        lambda: all(f"stage {n} admitted" in p.out.read_text() for n in REPLICAS),
        120,
        "every replica admitted",
        poll_s=0.5,
    )
    yield p
    p.stop()


def _request(i: int, spoken: bool = False, steps: int = 2, tokens: int = 20) -> omni_pb2.GenerateRequest:
    req = omni_pb2.GenerateRequest(
        request_id=f"rep-{i}",
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Hello there.")])
        ],
        sampling=common_pb2.SamplingParams(max_tokens=tokens if spoken else 6, ignore_eos=True, seed=i),
    )
    if spoken:
        req.output_modalities[:] = [omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO]
        # Sampled, not greedy: the random model's greedy answer can repeat one unspeakable token.
        req.sampling.temperature = 1.0
    else:
        req.output_modalities[:] = [omni_pb2.MODALITY_IMAGE]
        req.image.CopyFrom(omni_pb2.ImageOptions(width=128, height=128, steps=steps, seed=i))
    return req


async def _send(
    address: str,
    reqs: list[omni_pb2.GenerateRequest],
    timeout_s: float = 120.0,
    denoised: set[str] | None = None,
) -> list[tuple[str, omni_pb2.Finish | None]]:
    """Each request's outcome: ("OK", its finish) or (status: details, None); `denoised` gets the id of
    each request whose first image progress (a denoising step done) reached the client."""

    async def one(stub, req):
        finish = None
        try:
            async for ev in stub.Generate(req, timeout=timeout_s):
                if ev.WhichOneof("event") == "finish":
                    finish = ev.finish
                elif ev.WhichOneof("event") == "progress" and denoised is not None:
                    denoised.add(req.request_id)
            return "OK", finish
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}", None

    async with grpc.aio.insecure_channel(address) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        return list(await asyncio.gather(*(one(stub, r) for r in reqs)))


def test_calls_are_spread_over_both_replicas_of_each_stage(pipeline):
    before = {n: pipeline.calls(n, "Generate" if n.startswith("imagegen") else "Speak") for n in REPLICAS}
    outcomes = asyncio.run(
        _send(
            pipeline.gateway,
            [_request(i) for i in range(4)] + [_request(10 + i, spoken=True) for i in range(4)],
        )
    )
    assert [code for code, _ in outcomes] == ["OK"] * 8, outcomes
    spoken = [f for _, f in outcomes[4:]]
    assert all(f.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE for f in spoken), spoken
    after = {n: pipeline.calls(n, "Generate" if n.startswith("imagegen") else "Speak") for n in REPLICAS}
    assert all(after[n] > before[n] for n in REPLICAS), (before, after)


def test_a_killed_image_replica_fails_only_its_requests_naming_it_and_comes_back(pipeline):
    """Killed once every request has begun (a step's progress reached its client: two on each replica,
    each its batch of 2); a request not begun on a replica found unreachable goes to the other."""

    async def scenario() -> tuple[list, list]:
        # 30 steps: each replica's pair is still denoising when all four have begun (every step of the
        # two that finish is CPU: 60 took ~6 s more of it).
        slow_requests, denoised = [_request(20 + i, steps=30) for i in range(4)], set()
        slow = asyncio.create_task(_send(pipeline.gateway, slow_requests, denoised=denoised))
        deadline = time.monotonic() + 60
        while not (
            len(denoised) == len(slow_requests)
            and pipeline.denoising("imagegen")
            and pipeline.denoising("imagegen_b")
        ):
            assert time.monotonic() < deadline and not slow.done(), "the requests never denoised at once"
            await asyncio.sleep(0.2)
        os.kill(pipeline.pid("imagegen_b"), signal.SIGKILL)
        meanwhile = await _send(pipeline.gateway, [_request(30 + i) for i in range(3)])
        return await slow, meanwhile

    before_restart = pipeline.out.read_text().count("imagegen_b serving again")
    slow, meanwhile = asyncio.run(scenario())
    failed = [code for code, _ in slow if code != "OK"]
    assert failed and len(failed) < len(slow), slow  # imagegen_b's requests, not imagegen's
    assert all(code.startswith("UNAVAILABLE") and "imagegen_b" in code for code in failed), failed
    assert [code for code, _ in meanwhile] == ["OK"] * 3, meanwhile  # the other replica served them
    wait_for(
        lambda: pipeline.out.read_text().count("imagegen_b serving again") > before_restart,
        120,
        "the launcher to restart imagegen_b",
        poll_s=0.5,
    )
    wait_for(
        lambda: (
            capabilities_ready(pipeline.gateway, ["image_output"])
            and pipeline.out.read_text().count("stage imagegen_b SERVING again: re-admitted") >= 1
        ),
        60,
        "the gateway to admit imagegen_b again",
        poll_s=0.5,
    )
    after_back = pipeline.calls("imagegen_b", "Generate")  # its warm-up counted
    outcomes = asyncio.run(_send(pipeline.gateway, [_request(40 + i) for i in range(4)]))
    assert [code for code, _ in outcomes] == ["OK"] * 4, outcomes
    assert pipeline.calls("imagegen_b", "Generate") > after_back  # new requests reach it again


def test_a_killed_talker_replica_moves_its_speech_to_the_other_and_no_answer_loses_audio(pipeline):
    """One answer speaking on each talker when talker_b is killed, two more asked for at once after it
    (before the gateway knows: they may be sent to talker_b first). Speech on a loaded CPU host is slow:
    the deadlines are generous, the answers few."""

    async def scenario() -> tuple[list, list]:
        in_flight = asyncio.create_task(
            _send(pipeline.gateway, [_request(50 + i, spoken=True) for i in range(2)], 300.0)
        )
        deadline = time.monotonic() + 120
        while not (pipeline.streams("talker") and pipeline.streams("talker_b")):
            assert time.monotonic() < deadline and not in_flight.done(), "both talkers never spoke at once"
            await asyncio.sleep(0.1)
        os.kill(pipeline.pid("talker_b"), signal.SIGKILL)
        after = await _send(pipeline.gateway, [_request(60 + i, spoken=True) for i in range(2)], 300.0)
        return await in_flight, after

    in_flight, after = asyncio.run(scenario())
    assert [code for code, _ in in_flight + after] == ["OK"] * 4, in_flight + after
    statuses = [f.audio for _, f in in_flight + after]
    # talker_b's answer went on on talker from its next segment, talker's own was not disturbed, and the
    # new ones were spoken by talker.
    assert [s.outcome for s in statuses] == [omni_pb2.AUDIO_OUTCOME_COMPLETE] * 4, [
        (s.code, s.message) for s in statuses
    ]
    assert all(s.samples and s.segments for s in statuses), statuses
    assert "its speech goes on on talker from character" in pipeline.out.read_text()
