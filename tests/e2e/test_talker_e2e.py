"""The talker stage alone through `omnistage serve` on the tiny checkpoint, over real gRPC.

Speak with text in two messages → two segments of PCM16 that make a valid 44.1 kHz WAV; a custom
voice; a cancel mid-speech frees the stream's state (Describe and /metrics show 0 active); bad input
is INVALID_ARGUMENT naming the field while the service keeps serving; a stream above the stream cap
(what the budget holds, bounded by talker.max_streams; more than the step batch) is RESOURCE_EXHAUSTED
with grpc-retry-pushback-ms.
"""

from __future__ import annotations

import io
import math
import threading
import time
import urllib.request
import wave

import grpc
import numpy as np
import pytest
from omnistage.v1 import control_pb2, control_pb2_grpc, talker_pb2, talker_pb2_grpc

from tests.e2e.serve_pipeline import ServeProcess, exposition_with_codes, free_ports

pytestmark = pytest.mark.timeout(600)
STEP_BATCH = 2  # stress_batch_sizes [2, 1]: the streams one step advances
STREAMS = 3  # talker.max_streams: the cap on streams speaking at once (the 1 GiB budget holds more)


@pytest.fixture(scope="module")
def talker(tmp_path_factory):
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("talker-e2e")
    ckpt = write_tiny_checkpoint(root / "ckpt", seed=0)
    port, admin_port, metrics_port = free_ports(3)
    cfg = {
        "model": {"checkpoint": str(ckpt)},
        "startup": {
            "phase_deadlines_s": {
                "starting": 60,
                "loading_weights": 120,
                "profiling_memory": 120,
                "warming_up": 120,
            }
        },
        "services": {
            "talker": {
                "kind": "talker",
                "port": port,
                "admin_port": admin_port,
                "metrics_port": metrics_port,
                "memory": {"budget_bytes": 1 << 30, "simulated_capacity_bytes": 2 << 30},
                "talker": {
                    "stress_batch_sizes": [STEP_BATCH, 1],
                    "max_streams": STREAMS,
                    "max_segment_seconds": 20,
                    "max_lm_tokens": 512,
                    "max_text_chars": 400,
                    "max_reference_seconds": 5,
                },
            }
        },
    }
    serve = ServeProcess(root, cfg).wait_ready(300)
    yield {
        "address": f"127.0.0.1:{port}",
        "admin": f"127.0.0.1:{admin_port}",
        "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
    }
    serve.stop()


def _stub(talker) -> talker_pb2_grpc.TalkerStub:
    return talker_pb2_grpc.TalkerStub(grpc.insecure_channel(talker["address"]))


def _describe(talker) -> control_pb2.DescribeResponse:
    with grpc.insecure_channel(talker["admin"]) as ch:
        return control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=5)


def _metric(talker, name: str) -> float:
    text = urllib.request.urlopen(talker["metrics"], timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on /metrics")


def _config(**kw) -> talker_pb2.SpeakRequest:
    return talker_pb2.SpeakRequest(config=talker_pb2.SpeakConfig(**kw))


def test_describe_reports_the_stream_cap_and_the_step_batch(talker):
    desc = _describe(talker)
    assert desc.kind == control_pb2.STAGE_KIND_TALKER and desc.progress.phase == control_pb2.PHASE_SERVING
    assert desc.limits.max_running_requests == STREAMS and desc.limits.max_step_batch == STEP_BATCH
    (mem,) = desc.memory
    assert mem.weights_bytes > 0 and mem.kv_cache_bytes > 0 and mem.budget_bytes == 1 << 30


def test_two_segments_make_a_valid_44k_wav(talker, tmp_path):
    requests = [
        _config(request_id="e2e", seed=7),
        talker_pb2.SpeakRequest(text="Hello there, my good friend. "),
        talker_pb2.SpeakRequest(text="How are you doing today?", end_of_text=True),
    ]
    events = list(_stub(talker).Speak(iter(requests), timeout=120))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    started = events[0].started
    assert (started.request_id, started.sample_rate_hz, started.channels, started.voice) == (
        "e2e",
        44100,
        1,
        "DB30",
    )
    done = [e.segment_done for e in events if e.HasField("segment_done")]
    assert [d.text for d in done] == ["Hello there, my good friend.", "How are you doing today?"]
    # where each ends in the stream's text, both messages together (a moved stream goes on from there)
    assert [d.text_end for d in done] == [
        len("Hello there, my good friend."),
        len(requests[1].text + requests[2].text),
    ]
    chunks = [e.audio for e in events if e.HasField("audio")]
    pcm = b"".join(c.pcm16 for c in chunks)
    offsets = np.cumsum([0] + [len(c.pcm16) // 2 for c in chunks])[:-1]
    assert [c.start_sample for c in chunks] == offsets.tolist()  # in order, no gaps or overlaps
    assert [c.segment_index for c in chunks] == sorted(c.segment_index for c in chunks) and chunks[
        -1
    ].segment_index == 1
    assert sum(d.num_samples for d in done) == len(pcm) // 2 == events[-1].finished.total_samples
    path = tmp_path / "speech.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(started.sample_rate_hz)
        w.writeframes(pcm)
    with wave.open(str(path), "rb") as r:
        assert (r.getnchannels(), r.getsampwidth(), r.getframerate()) == (1, 2, 44100)
        samples = np.frombuffer(r.readframes(r.getnframes()), "<i2")
    assert samples.size == len(pcm) // 2 and samples.size > 44100  # over a second of speech
    assert np.abs(samples).mean() > 30  # not silence
    again = list(_stub(talker).Speak(iter(requests), timeout=120))  # the same seed: the same audio
    assert b"".join(e.audio.pcm16 for e in again if e.HasField("audio")) == pcm


def _wav(seconds: float, rate: int = 22050) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((0.3 * np.sin(2 * math.pi * 220 * t) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def test_a_custom_voice_speaks(talker):
    custom = talker_pb2.CustomVoice(audio=_wav(1.2), transcript="A short reference clip.")
    events = list(
        _stub(talker).Speak(
            iter(
                [_config(custom_voice=custom, seed=1), talker_pb2.SpeakRequest(text="Hi.", end_of_text=True)]
            ),
            timeout=120,
        )
    )
    assert events[0].started.voice == "custom"
    assert events[-1].finished.total_samples > 0


def _wait_idle(talker) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _describe(talker).running_requests == 0 and _metric(talker, "omnistage_talker_active_jobs") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(
        f"still active: {_describe(talker).running_requests} streams, "
        f"{_metric(talker, 'omnistage_talker_active_jobs')} jobs"
    )


def test_a_cancel_mid_speech_frees_the_stream(talker):
    gate = threading.Event()

    def requests():
        yield _config(seed=3)
        yield talker_pb2.SpeakRequest(
            text="This sentence is long enough to take many talker steps to say. " * 3, flush=True
        )
        gate.wait(60)  # keep the stream open: the client cancels before it ends

    call = _stub(talker).Speak(requests(), timeout=120)
    for event in call:
        if event.HasField("audio"):
            break
    assert _describe(talker).running_requests == 1
    deadline = time.monotonic() + 10  # three segments queued: one of them holds talker state almost always
    while _metric(talker, "omnistage_talker_active_jobs") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _metric(talker, "omnistage_talker_active_jobs") == 1
    call.cancel()
    gate.set()
    _wait_idle(talker)


@pytest.mark.parametrize(
    ("requests", "needle"),
    [
        (
            [_config(voice="nobody"), talker_pb2.SpeakRequest(text="Hi.", end_of_text=True)],
            "config.voice: unknown voice 'nobody' (have: DB30, lingguang)",
        ),
        ([_config(), talker_pb2.SpeakRequest(text="  ... !!", end_of_text=True)], "text: nothing to speak"),
        (
            [_config(), talker_pb2.SpeakRequest(text="a" * 401, end_of_text=True)],
            "talker.max_text_chars (400",
        ),
        (
            [
                _config(custom_voice=talker_pb2.CustomVoice(audio=b"RIFF not a wav", transcript="x")),
                talker_pb2.SpeakRequest(text="Hi.", end_of_text=True),
            ],
            "config.custom_voice.audio: not a decodable audio file",
        ),
        (
            [
                _config(custom_voice=talker_pb2.CustomVoice(audio=_wav(6.0), transcript="x")),
                talker_pb2.SpeakRequest(text="Hi.", end_of_text=True),
            ],
            "config.custom_voice.audio: longer than 5 s",
        ),
        (
            [_config(custom_voice=talker_pb2.CustomVoice(audio=_wav(1.0)))],
            "config.custom_voice.transcript: required",
        ),
        ([talker_pb2.SpeakRequest(text="Hi.")], "config: required in the first message"),
        ([_config(), _config()], "config: only the first message may carry it"),
    ],
    ids=[
        "unknown-voice",
        "no-speakable-text",
        "text-too-long",
        "corrupt-clip",
        "clip-too-long",
        "no-transcript",
        "no-config",
        "config-twice",
    ],
)
def test_bad_input_is_named_and_the_service_keeps_serving(talker, requests, needle):
    with pytest.raises(grpc.RpcError) as err:
        list(_stub(talker).Speak(iter(requests), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    ok = list(
        _stub(talker).Speak(
            iter([_config(seed=1), talker_pb2.SpeakRequest(text="Fine.", end_of_text=True)]), timeout=120
        )
    )
    assert ok[-1].finished.total_samples > 0
    _wait_idle(talker)


def test_streams_beyond_the_cap_are_refused_with_pushback(talker):
    gates, calls = [], []
    for _ in range(STREAMS):
        gate = threading.Event()
        gates.append(gate)

        def requests(gate=gate):
            yield _config(seed=1)
            gate.wait(60)

        call = _stub(talker).Speak(requests(), timeout=120)
        calls.append(call)
        assert next(call).HasField("started")  # holds a slot
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(
                _stub(talker).Speak(
                    iter([_config(), talker_pb2.SpeakRequest(text="Hi.", end_of_text=True)]), timeout=30
                )
            )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"] == "500"
    finally:
        for call, gate in zip(calls, gates, strict=True):
            call.cancel()
            gate.set()
    _wait_idle(talker)


def test_metrics_pass_promtool_check_metrics(talker, check_metrics):
    """/metrics after this test's own traffic (a spoken sentence, a refused request), whatever ran before
    it: the labelled series they count are there and pass promtool (tests/deploy checks the names)."""
    ok = list(
        _stub(talker).Speak(
            iter([_config(seed=1), talker_pb2.SpeakRequest(text="Fine.", end_of_text=True)]), timeout=120
        )
    )
    assert ok[-1].finished.total_samples > 0
    with pytest.raises(grpc.RpcError):
        list(_stub(talker).Speak(iter([talker_pb2.SpeakRequest(text="Hi.")]), timeout=60))
    _wait_idle(talker)
    check_metrics(exposition_with_codes(talker["metrics"], "OK", "INVALID_ARGUMENT"))
