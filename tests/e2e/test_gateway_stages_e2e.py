"""The gateway as a stage table on the tiny pipeline (`omnistage serve`: thinker, a talker of one stream,
the gateway), over real gRPC:

- more spoken requests than talker streams (issue 38): every text streams and completes without
  waiting for audio, each answer's audio is precise (complete, or RESOURCE_EXHAUSTED with a retry
  hint once no stream freed within gateway.talker_stream_wait_s), and nothing is left held;
- a fake output stage added as a new one is (issue 41): one row of the stage table, one adapter module,
  one client (tests/e2e/sketch_output.py), served end to end by a gateway whose start-up iterates the
  table, on the pipeline's thinker.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc
from omnistage.common.config import GatewayConfig
from omnistage.common.stages import STAGES
from omnistage.v1 import common_pb2, imagegen_pb2, imagegen_pb2_grpc, omni_pb2, omni_pb2_grpc

from tests.e2e.serve_pipeline import ServeProcess, free_ports, metric
from tests.services.gateway.test_gateway_talker_failover import Health

pytestmark = pytest.mark.timeout(900)
STREAMS = 1  # the talker's stream cap (its start-up stress: stress_batch_sizes [1])
SPOKEN = 4  # spoken requests at once: more than the talker's streams


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("stages-e2e")
    ckpt = write_tiny_checkpoint(root / "ckpt", seed=0)
    th, th_admin, th_metrics, dist, tk, tk_admin, tk_metrics, gw, gw_admin, gw_metrics = free_ports(10)
    cfg = {
        "model": {"checkpoint": str(ckpt)},
        "startup": {"phase_deadlines_s": {"starting": 60, "loading_weights": 240, "warming_up": 240}},
        "services": {
            "thinker": {
                "kind": "thinker",
                "port": th,
                "admin_port": th_admin,
                "metrics_port": th_metrics,
                "dist_port": dist,
                "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 128, "max_model_len": 512},
            },
            "talker": {
                "kind": "talker",
                "port": tk,
                "admin_port": tk_admin,
                "metrics_port": tk_metrics,
                "talker": {"stress_batch_sizes": [STREAMS], "max_segment_seconds": 20, "max_lm_tokens": 512},
            },
            "gateway": {
                "kind": "gateway",
                "port": gw,
                "admin_port": gw_admin,
                "metrics_port": gw_metrics,
                "gateway": {"talker_stream_wait_s": 1.0},
            },
        },
    }
    serve = ServeProcess(root, cfg).wait_ready(600)
    yield {
        "gateway": f"127.0.0.1:{gw}",
        "thinker": f"127.0.0.1:{th}",
        "gateway_metrics": f"http://127.0.0.1:{gw_metrics}/metrics",
    }
    serve.stop()


def _spoken(i: int) -> omni_pb2.GenerateRequest:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=f"Tell me {i}.")])
    return omni_pb2.GenerateRequest(
        request_id=f"spoken-{i}",
        messages=[msg],
        output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
        sampling=common_pb2.SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0),
    )


def test_more_spoken_requests_than_talker_streams_all_stream_their_text_at_once(pipeline):
    """Each request's events in one global order: every text's first delta comes before any Finish (the
    first answer to speak holds the talker's one stream for its whole audio; on main the others' text
    waited in the gateway for that stream)."""
    order: list[tuple[int, str]] = []  # (request, event kind), in arrival order across the requests
    lock = threading.Lock()
    finishes: dict[int, omni_pb2.Finish] = {}
    texts: dict[int, int] = {}

    def client(i: int) -> None:
        with grpc.insecure_channel(pipeline["gateway"]) as channel:
            for event in omni_pb2_grpc.OmniStub(channel).Generate(_spoken(i), timeout=300):
                kind = event.WhichOneof("event")
                with lock:
                    order.append((i, kind))
                if kind == "text":
                    texts[i] = texts.get(i, 0) + len(event.text.token_ids)
                elif kind == "finish":
                    finishes[i] = event.finish

    with ThreadPoolExecutor(SPOKEN) as pool:
        list(pool.map(client, range(SPOKEN)))
    first_finish = next(n for n, (_, kind) in enumerate(order) if kind == "finish")
    first_text = {
        i: next(n for n, (j, kind) in enumerate(order) if j == i and kind == "text") for i in range(SPOKEN)
    }
    assert all(n < first_finish for n in first_text.values()), order
    outcomes = []
    for i in range(SPOKEN):
        finish = finishes[i]
        assert finish.reason == common_pb2.FINISH_REASON_LENGTH and texts[i] == 16  # every text whole
        audio = finish.audio
        if audio.outcome != omni_pb2.AUDIO_OUTCOME_COMPLETE:
            assert (audio.outcome, audio.code) == (omni_pb2.AUDIO_OUTCOME_NONE, "RESOURCE_EXHAUSTED"), audio
            assert audio.retry_after_ms > 0 and "talker_stream_wait_s" in audio.message
        outcomes.append(audio.outcome)
    assert omni_pb2.AUDIO_OUTCOME_COMPLETE in outcomes
    labels = '{service="gateway",stage="talker"}'
    assert metric(pipeline["gateway_metrics"], f"omnistage_gateway_admission_running{labels}") == 0
    assert metric(pipeline["gateway_metrics"], f"omnistage_gateway_admission_waiting{labels}") == 0


class _Sketcher(imagegen_pb2_grpc.ImageGenServicer):
    """The sketch stage: a progress event, then an "image" of the words it was given."""

    def __init__(self) -> None:
        self.words: list[str] = []

    async def Generate(self, request, context):
        self.words.append(request.prompt_text)
        yield imagegen_pb2.ImageGenEvent(progress=imagegen_pb2.ImageGenProgress(step=1, total_steps=1))
        png = f"sketch of {request.prompt_text}".encode()
        yield imagegen_pb2.ImageGenEvent(image=imagegen_pb2.ImageGenImage(png=png, width=1, height=1))


class _Runtime:
    """What the gateway's start-up asks of its service runtime, here in the test's process."""

    class _Reporter:
        def heartbeat(self, _text: str) -> None: ...

    def __init__(self) -> None:
        self.reporter, self.hooks = self._Reporter(), []

    def add_shutdown_hook(self, hook) -> None:
        self.hooks.append(hook)

    def set_capability_health(self, _ready: dict) -> None: ...


def test_a_fake_output_stage_added_as_one_row_one_adapter_one_client_serves_end_to_end(pipeline, monkeypatch):
    from omnistage.services.gateway.outputs import output_stage
    from omnistage.services.gateway.pipeline import Pipeline
    from omnistage.services.gateway.server import OmniServicer
    from omnistage.services.gateway.stages import ThinkerClient
    from omnistage.services.gateway.startup import Stages
    from omnistage.services.gateway.validation import RequestLimits

    from tests.e2e import sketch_output

    monkeypatch.setitem(sys.modules, "omnistage.services.gateway.outputs.sketch", sketch_output)
    table = (*(s for s in STAGES if s.kind != "imagegen"), sketch_output.SKETCH_ROW)  # the row

    async def scenario():
        sketcher, server = _Sketcher(), grpc.aio.server()
        imagegen_pb2_grpc.add_ImageGenServicer_to_server(sketcher, server)
        health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        cls = output_stage("sketch")  # the adapter, found by its kind
        stage = cls([cls.client_class("sketch", f"127.0.0.1:{port}", 1 << 20)])
        thinker = ThinkerClient("thinker", pipeline["thinker"], 1 << 22)
        servicer = OmniServicer(
            Pipeline(
                thinker,
                {"thinker", "sketch"},
                max_concurrent_requests=8,
                limits=RequestLimits(),
                system_prompt="",
                outputs=[stage],
                stages=table,
                service="gw-sketch",
            )
        )
        runtime = _Runtime()
        stages = Stages(runtime, GatewayConfig(stage_health_interval_s=0.2), servicer, table)
        stages.start()
        try:
            await stages.needs_thinker("the test")
            assert await stages.watches["sketch"].wait_admitted(120.0)
            request = _spoken(7)
            del request.output_modalities[:]
            request.output_modalities.extend([omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_IMAGE])
            events = [e async for e in servicer.Generate(request, _Deadline(120.0))]
        finally:
            for hook in runtime.hooks:
                await hook()
            await thinker.close()
            await stage.close()
            await server.stop(None)
        return events, sketcher.words

    events, words = asyncio.run(scenario())
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[-3:] == ["progress", "image", "finish"] and kinds.count("text") >= 1
    assert set(kinds[:-3]) == {"text"}  # the answer first, then the stage's part after it
    assert events[-2].image.png == b"sketch of Tell me 7." and words[-1] == "Tell me 7."
    assert events[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def time_remaining(self) -> float:
        return self.seconds
