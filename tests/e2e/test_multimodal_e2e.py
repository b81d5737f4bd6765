"""Media end to end through `omnistage serve` on the tiny checkpoint: gateway → encoder → thinker.

Text + image, audio, video and several images answer; the embeddings reach the thinker through shared
memory (its transport counter) and every encoder lease returns (its gauge); a request's greedy tokens
are the same alone and batched, and at TP=2; bad media is refused naming the part; a refused or
cancelled request leaves no lease. TP=1 is the full tiny pipeline the e2e tests share
(tests/e2e/full_pipeline.py, the API key presented), TP=2 a start of its own of the same sizes; SIGTERM
stops each with exit 0 and leaves no process or shared-memory segment (the shared one's `stop`; the TP=2
start also gives the TP=1 greedy text tokens and stops every rank: what tests/e2e/test_serve_tp.py
started two gateway + thinker pipelines for).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from omnistage.common.runtime.auth import bearer
from omnistage.v1 import common_pb2, control_pb2, control_pb2_grpc, omni_pb2, omni_pb2_grpc

from tests.e2e.full_pipeline import ENCODER, ENGINE, KEY
from tests.e2e.serve_pipeline import ServeProcess, free_port_block, free_ports, metric
from tests.services.encoder.media_samples import audio_file, image_bytes, video_file

pytestmark = pytest.mark.timeout(600)
START_DEADLINE_S = 240.0
MAX_MODEL_LEN = ENGINE["max_model_len"]
IMAGES = [image_bytes(128, 96, seed=1), image_bytes(96, 64, seed=2), image_bytes(64, 64, seed=3)]
AUDIO = audio_file("wav", 1.0)
VIDEO = video_file(8, fps=4, width=96, height=64)


def _text(t: str) -> omni_pb2.ContentPart:
    return omni_pb2.ContentPart(text=t)


def _image(data: bytes = IMAGES[0]) -> omni_pb2.ContentPart:
    return omni_pb2.ContentPart(image=omni_pb2.Media(data=data))


REQUESTS = {
    "image": [_text("Describe the image."), _image()],
    "audio": [omni_pb2.ContentPart(audio=omni_pb2.Media(data=AUDIO)), _text("Transcribe it.")],
    "video": [omni_pb2.ContentPart(video=omni_pb2.Media(data=VIDEO)), _text("What happens?")],
    "images": [_text("Compare:"), *(_image(d) for d in IMAGES)],
}
MEDIA_ITEMS = {"image": 1, "audio": 1, "video": 1, "images": 3}


def request(parts, max_tokens: int = 8, request_id: str = "") -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=parts)],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


class MediaCalls:
    """Requests through a gateway (`auth`: its API key, when it asks for one) and what the thinker and
    the encoder hold: shared by the TP=1 pipeline (the e2e tests' shared one) and the TP=2 one."""

    gateway: str
    auth: tuple = ()
    media_dir: Path
    thinker_admin: str
    thinker_metrics: str
    encoder_metrics: str

    def generate(self, req: omni_pb2.GenerateRequest, timeout: float = 120) -> list[omni_pb2.GenerateEvent]:
        with grpc.insecure_channel(self.gateway) as ch:
            return list(omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=timeout, metadata=self.auth))

    def tokens(self, req: omni_pb2.GenerateRequest) -> list[int]:
        events = self.generate(req)
        assert events[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH, events[-1]
        return [t for e in events if e.WhichOneof("event") == "text" for t in e.text.token_ids]

    def shm_decodes(self) -> float:
        """Tensors the thinker (rank 0) decoded from shared memory."""
        return metric(
            self.thinker_metrics,
            'omnistage_transport_tensors_total{direction="decode",path="shm",service="thinker"}',
            0.0,
        )

    def leases(self) -> float:
        return metric(self.encoder_metrics, "omnistage_encoder_leases_active{")

    def wait_no_leases(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.leases() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.leases() == 0, "encoder leases left behind"

    def thinker_busy(self) -> int:
        with grpc.insecure_channel(self.thinker_admin) as ch:
            desc = control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=5)
        return desc.running_requests + desc.queued_requests


class SharedPipeline(MediaCalls):
    """TP=1: the full tiny pipeline the e2e tests share (tests/e2e/full_pipeline.py; its sizes are
    ENGINE and ENCODER, its media directory the gateway's; its stop checks what `stop_leaving_nothing`
    checks here)."""

    def __init__(self, shared: dict) -> None:
        ports = shared["ports"]
        self.gateway, self.auth, self.media_dir = shared["grpc"], bearer(KEY), shared["media_dir"]
        self.thinker_admin = f"127.0.0.1:{ports['thinker']['admin_port']}"
        self.thinker_metrics = f"http://127.0.0.1:{ports['thinker']['metrics_port']}/metrics"
        self.encoder_metrics = f"http://127.0.0.1:{ports['encoder']['metrics_port']}/metrics"


class Pipeline(MediaCalls, ServeProcess):
    """`omnistage serve` of gateway + encoder + thinker (TP `tp_size`) of the shared pipeline's sizes;
    output in files."""

    def __init__(self, root: Path, ckpt: Path, tp_size: int) -> None:
        (gw, gw_admin, th, th_admin, th_metrics, enc, enc_admin, enc_metrics) = free_ports(8)
        dist = free_port_block(tp_size)
        self.media_dir = root / "media"
        self.media_dir.mkdir(exist_ok=True)
        cfg = {
            "model": {"checkpoint": str(ckpt)},
            "startup": {
                "stop_grace_s": 5.0,
                "phase_deadlines_s": {"loading_weights": 120, "profiling_memory": 120, "warming_up": 120},
            },
            "services": {
                "thinker": {
                    "kind": "thinker",
                    "port": th,
                    "admin_port": th_admin,
                    "metrics_port": th_metrics,
                    "tp_size": tp_size,
                    "dist_port": dist,
                    "drain_grace_s": 2.0,
                    "engine": ENGINE,
                },
                "encoder": {
                    "kind": "encoder",
                    "port": enc,
                    "admin_port": enc_admin,
                    "metrics_port": enc_metrics,
                    "encoder": ENCODER,
                },
                "gateway": {
                    "kind": "gateway",
                    "port": gw,
                    "admin_port": gw_admin,
                    "gateway": {"media_dir": str(self.media_dir)},
                },
            },
        }
        ServeProcess.__init__(self, root, cfg, f"-tp{tp_size}", err_apart=True)
        self.tp_size = tp_size
        self.gateway = f"127.0.0.1:{gw}"
        self.thinker_admin = f"127.0.0.1:{th_admin}"
        self.thinker_metrics = f"http://127.0.0.1:{th_metrics}/metrics"
        self.encoder_metrics = f"http://127.0.0.1:{enc_metrics}/metrics"

    def wait_ready(self) -> Pipeline:
        super().wait_ready(START_DEADLINE_S)
        return self

    def stop_leaving_nothing(self) -> None:
        """SIGTERM (exit 0, `ServeProcess.stop`) after which every rank the launcher started is gone, no
        process nor shared-memory segment of it is left, and no service failed while stopping."""
        started = set(self.children())
        self.stop()
        left = self.leftovers()
        assert not left, f"left behind: {left}"
        ranks = {("thinker", r) for r in range(self.tp_size)} | {("gateway", 0), ("encoder", 0)}
        assert started == ranks, started
        out = self.out.read_text()
        assert f"thinker r{self.tp_size - 1} serving" in out and "all services stopped" in out, self.logs()
        assert "while stopping" not in self.err.read_text(), self.logs()  # every rank left cleanly


@pytest.fixture(scope="module")
def pipeline(shared_pipeline):
    return SharedPipeline(shared_pipeline)


@pytest.fixture(scope="module")
def alone(pipeline) -> dict[str, list[int]]:
    """Each request alone at TP=1 (greedy)."""
    return {name: pipeline.tokens(request(parts)) for name, parts in REQUESTS.items()}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_each_modality_answers_with_embeddings_by_shared_memory(pipeline, alone, name):
    before = pipeline.shm_decodes()
    events = pipeline.generate(request(REQUESTS[name]))
    finish = events[-1].finish
    assert finish.reason == common_pb2.FINISH_REASON_LENGTH and finish.usage.completion_tokens == 8
    assert [t for e in events if e.WhichOneof("event") == "text" for t in e.text.token_ids] == alone[name]
    assert pipeline.shm_decodes() - before == MEDIA_ITEMS[name]
    pipeline.wait_no_leases()


def test_the_rows_reach_the_model(pipeline):
    """An image adds its placeholder tokens to the prompt, and what it shows moves the logits: two
    pictures of one size (the same prompt tokens) answer differently (the tiny random model's greedy
    tokens barely depend on the prompt, its log-probabilities do)."""

    def first_logprobs(parts) -> tuple[int, list[float]]:
        req = request(parts, max_tokens=1)
        req.sampling.logprobs = 5
        events = pipeline.generate(req)
        lp = next(e for e in events if e.WhichOneof("event") == "text").text.logprobs[0]
        return events[-1].finish.usage.prompt_tokens, list(lp.top_logprobs)

    text_only = first_logprobs([_text("Describe the image.")])
    image_a = first_logprobs(REQUESTS["image"])
    image_b = first_logprobs([_text("Describe the image."), _image(image_bytes(128, 96, seed=7))])
    assert image_a[0] == image_b[0] == text_only[0] + 2 + 12 + 1  # <image> 12 x <imagePatch> </image> "\n"
    for x, y in [(text_only, image_a), (image_a, image_b)]:
        assert max(abs(a - b) for a, b in zip(x[1], y[1], strict=True)) > 1e-4


def test_concurrent_requests_give_their_alone_tokens(pipeline, alone):
    names = list(REQUESTS) * 3
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: pipeline.tokens(request(REQUESTS[n])), names))
    assert got == [alone[n] for n in names]
    pipeline.wait_no_leases()


def test_a_media_path_is_read_by_the_gateway(pipeline, alone):
    (pipeline.media_dir / "picture.png").write_bytes(IMAGES[0])
    parts = [_text("Describe the image."), omni_pb2.ContentPart(image=omni_pb2.Media(path="picture.png"))]
    assert pipeline.tokens(request(parts)) == alone["image"]


@pytest.mark.parametrize(
    "parts, needle",
    [
        ([_text("Look:"), _image(b"not an image at all")], "messages[0].parts[1].image: "),
        (
            [_image(), omni_pb2.ContentPart(audio=omni_pb2.Media(data=b"RIFF1234WAVEjunk"))],
            "messages[0].parts[1].audio",
        ),
    ],
    ids=["image", "audio"],
)
def test_bad_media_is_refused_naming_the_part(pipeline, parts, needle):
    with pytest.raises(grpc.RpcError) as err:
        pipeline.generate(request(parts))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details(), err.value.details()
    pipeline.wait_no_leases()


def test_a_request_the_thinker_refuses_leaves_no_lease(pipeline):
    with pytest.raises(grpc.RpcError) as err:
        pipeline.generate(request(REQUESTS["images"], max_tokens=MAX_MODEL_LEN - 10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert details.startswith(f"thinker: sampling.max_tokens: {MAX_MODEL_LEN - 10} + a prompt of "), details
    assert details.endswith(f"token(s) exceeds max_model_len {MAX_MODEL_LEN}"), details
    pipeline.wait_no_leases()


def test_a_cancelled_request_leaves_no_lease_and_no_work(pipeline):
    with grpc.insecure_channel(pipeline.gateway) as ch:
        call = omni_pb2_grpc.OmniStub(ch).Generate(
            request(REQUESTS["video"], max_tokens=150), timeout=60, metadata=pipeline.auth
        )
        first = next(call)
        assert first.WhichOneof("event") == "text"
        call.cancel()
    deadline = time.monotonic() + 30
    while pipeline.thinker_busy() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pipeline.thinker_busy() == 0
    pipeline.wait_no_leases()


TEXT = [_text("Count to ten.")]


@pytest.mark.slow
def test_tp2_gives_the_tp1_tokens_alone_and_batched_and_sigterm_stops_every_rank(
    tmp_path_factory, tiny_ckpt, pipeline, alone
):
    """Media and plain text: the same greedy tokens at TP=2 as at TP=1; SIGTERM then stops both ranks."""
    text_tp1 = pipeline.tokens(request(TEXT, max_tokens=12))
    assert len(text_tp1) == 12
    p = Pipeline(tmp_path_factory.mktemp("mm-tp2"), tiny_ckpt, 2).wait_ready()
    try:
        assert p.tokens(request(TEXT, max_tokens=12)) == text_tp1
        before = p.shm_decodes()
        got = {name: p.tokens(request(parts)) for name, parts in REQUESTS.items()}
        assert got == alone
        assert p.shm_decodes() - before == sum(MEDIA_ITEMS.values())
        results: dict[int, list[int]] = {}
        names = list(REQUESTS) * 2

        def one(i: int) -> None:
            results[i] = p.tokens(request(REQUESTS[names[i]]))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(names))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [results.get(i) for i in range(len(names))] == [alone[n] for n in names]
        p.wait_no_leases()
    except BaseException:
        p.leftovers()  # killed with every process of it, so that nothing reaches the next test
        raise
    p.stop_leaving_nothing()
