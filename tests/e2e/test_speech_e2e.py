"""Speech through the gateway on the tiny checkpoint: gateway + thinker + talker + encoder as real
processes, over real gRPC.

Generate with MODALITY_AUDIO streams text and audio in one stream, and the audio makes a valid 44.1 kHz
WAV; Converse answers two turns from the history (the second prompt repeats the first and its
answer's ids exactly, and the thinker's prefix cache serves most of it), a barge-in (a spoken turn) ends the answer running INTERRUPTED and frees its talker
stream; a client that cancels mid-speech frees the talker stream; with the talker killed, a Generate
with audio still completes its text and says why there is no audio.

The services are started one process each (as `omnistage serve` starts them, with a stage key, without
its supervision: the launcher stops the whole pipeline when a stage dies, and one test kills the
talker to see what the gateway does without it, then starts it again). One pipeline for the module;
when it stops, the gateway's log has no report of a task or generator left to the GC.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import threading
import urllib.request
import wave
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from omnistage.common.client import wav_bytes as wav_of
from omnistage.common.runtime import auth
from omnistage.common.runtime.status_file import read_status, status_path
from omnistage.services.thinker.models.tokenizer import MingTokenizer
from omnistage.v1 import common_pb2, control_pb2, control_pb2_grpc, omni_pb2, omni_pb2_grpc

from tests.e2e.serve_pipeline import capabilities_ready, free_ports, wait_started
from tests.waits import wait_for

pytestmark = pytest.mark.timeout(600)
START_DEADLINE_S = 300.0
MAX_SEGMENT_SECONDS = 3.0  # every sentence spoken at most this long: short tests
SAMPLE_RATE_HZ = 44100
IDLE_DEADLINE_S = 30.0
# The deployment's stage key, as `omnistage serve` gives one to every process: the gateway's stage
# channels then carry grpc's client interceptors (the path production runs), and the stages' ports
# take only callers that present it.
STAGE_KEY = secrets.token_urlsafe(24)
# What asyncio logs when a task or an async generator was left to the garbage collector.
LEFT_TO_GC = (
    "Task was destroyed but it is pending",
    "Task exception was never retrieved",
    "asynchronous generator is already running",
    "an error occurred during closing of asynchronous generator",
)


class Pipeline:
    """One process per service (`python -m omnistage.services.<kind>`), all started at once: the gateway
    waits for its stages itself (gateway.stage_wait_s) and warms up through them."""

    SERVICES = ("thinker", "talker", "encoder", "gateway")

    def __init__(self, root: Path) -> None:
        from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

        ckpt = write_tiny_checkpoint(root / "ckpt", seed=0)
        (
            th,
            th_admin,
            th_metrics,
            dist,
            tk,
            tk_admin,
            tk_metrics,
            enc,
            enc_admin,
            enc_metrics,
            gw,
            gw_admin,
            gw_metrics,
        ) = free_ports(13)
        cfg = {
            "model": {"checkpoint": str(ckpt)},
            "startup": {
                "phase_deadlines_s": {
                    "starting": 60,
                    "loading_weights": 240,
                    "profiling_memory": 240,
                    "warming_up": 240,
                }
            },
            "services": {
                "thinker": {
                    "kind": "thinker",
                    "port": th,
                    "admin_port": th_admin,
                    "metrics_port": th_metrics,
                    "dist_port": dist,
                    "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 128, "max_model_len": 512},
                },
                # Two streams at once: a barge-in's new answer may open its stream while the old one closes.
                "talker": {
                    "kind": "talker",
                    "port": tk,
                    "admin_port": tk_admin,
                    "metrics_port": tk_metrics,
                    "talker": {
                        "stress_batch_sizes": [2, 1],
                        "max_segment_seconds": MAX_SEGMENT_SECONDS,
                        "max_lm_tokens": 512,
                    },
                },
                "encoder": {
                    "kind": "encoder",
                    "port": enc,
                    "admin_port": enc_admin,
                    "metrics_port": enc_metrics,
                    "encoder": {
                        "image_max_pixels": 64 * 64,
                        "video_min_pixels": 32 * 32,
                        "video_total_pixels": 4 * 64 * 64,
                        "max_video_frames": 4,
                        "max_audio_seconds": 2.0,
                        "stress_batch_sizes": [1],
                    },
                },
                "gateway": {
                    "kind": "gateway",
                    "port": gw,
                    "admin_port": gw_admin,
                    "metrics_port": gw_metrics,
                    # Every answer spoken: an answer's audio waits for one of the talker's two streams
                    # as long as the CPU talker takes to free one (its text never waits).
                    "gateway": {"talker_stream_wait_s": 120.0},
                },
            },
        }
        self.root = root
        self.cfg_path = root / "deploy.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg))
        self.run_dir = root / "run"
        self.procs: dict[str, subprocess.Popen] = {}
        for name in self.SERVICES:
            self.start(name)
        self.gateway = f"127.0.0.1:{gw}"
        self.thinker_admin = f"127.0.0.1:{th_admin}"
        self.talker_admin = f"127.0.0.1:{tk_admin}"
        self.talker_metrics = f"http://127.0.0.1:{tk_metrics}/metrics"
        self.gateway_metrics = f"http://127.0.0.1:{gw_metrics}/metrics"

    def start(self, name: str) -> None:
        """Start service `name` (again: its log goes on)."""
        with open(self.root / f"{name}.log", "a") as log:
            self.procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    f"omnistage.services.{name}",
                    "--config",
                    str(self.cfg_path),
                    "--service",
                    name,
                    "--rank",
                    "0",
                    "--run-dir",
                    str(self.run_dir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(
                    os.environ,
                    PYTHONUNBUFFERED="1",
                    OMNISTAGE_SERVICE=name,
                    **{auth.STAGE_KEY_ENV: STAGE_KEY},
                ),
            )

    def logs(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()[-3000:]

    def all_logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.logs(name)}" for name in self.SERVICES)

    def serving(self) -> bool:
        rec = read_status(status_path(self.run_dir, "gateway", 0))
        return (
            rec is not None
            and rec.phase == "serving"
            and capabilities_ready(self.gateway, ["text", "speech", "media_input"])
        )

    def exited(self) -> str:
        return ", ".join(
            f"{name} (exit {proc.returncode})" for name, proc in self.procs.items() if proc.poll() is not None
        )

    def wait_ready(self) -> Pipeline:
        wait_started(
            "the speech pipeline",
            self.serving,
            self.exited,
            START_DEADLINE_S,
            self.run_dir,
            self.all_logs,
            on_failure=lambda: self.stop(check=False),
        )
        return self

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self, check: bool = True) -> None:
        """SIGTERM to every live service, gateway first; each must exit 0 (a hang at shutdown fails)."""
        live = {n: p for n, p in reversed(self.procs.items()) if p.poll() is None}
        for proc in live.values():
            os.killpg(proc.pid, signal.SIGTERM)
        codes = {}
        for name, proc in live.items():
            try:
                codes[name] = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes[name] = "hung"
        if check:
            assert all(code == 0 for code in codes.values()), f"exits {codes}:\n{self.all_logs()}"
            log = (self.root / "gateway.log").read_text()
            left = [line for line in log.splitlines() if any(s in line for s in LEFT_TO_GC)]
            assert not left, "the gateway left tasks or generators to the GC:\n" + "\n".join(left[:10])


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    p = Pipeline(tmp_path_factory.mktemp("speech-e2e")).wait_ready()
    yield p
    p.stop()


def _user(text: str) -> omni_pb2.ChatMessage:
    return omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=text)])


# The tiny model's answer to this prompt with this seed has a sentence end ("!") within its first
# tokens: the talker speaks it as two segments, the first while the thinker still decodes.
PROMPT, SEED = "Hello there, how are you?", 33


def _spoken_request(max_tokens: int, request_id: str = "", text: str = PROMPT) -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=[_user(text)],
        output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
        sampling=common_pb2.SamplingParams(
            temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=SEED
        ),
    )


def _kinds(events) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def _tokens(events) -> list[int]:
    return [t for e in events if e.HasField("text") for t in e.text.token_ids]


def _text(events) -> str:
    return "".join(e.text.text for e in events if e.HasField("text"))


def _describe(address: str) -> control_pb2.DescribeResponse:
    """A stage's Describe (its admin port takes the stage key)."""
    with grpc.insecure_channel(address) as ch:
        return control_pb2_grpc.ControlStub(ch).Describe(
            control_pb2.DescribeRequest(), timeout=5, metadata=auth.bearer(STAGE_KEY)
        )


def _metric(url: str, name: str) -> float:
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on {url}")


def _speak_calls(pipeline: Pipeline) -> dict[str, float]:
    """The talker's Speak calls by the status they ended with."""
    calls = {}
    for line in urllib.request.urlopen(pipeline.talker_metrics, timeout=5).read().decode().splitlines():
        if line.startswith("omnistage_rpc_requests_total{") and 'method="Speak"' in line:
            calls[line.split('code="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return calls


def _more_calls(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {code: n - before.get(code, 0.0) for code, n in after.items() if n != before.get(code, 0.0)}


def _talker_busy(pipeline: Pipeline) -> tuple[int, float]:
    return (
        _describe(pipeline.talker_admin).running_requests,
        _metric(pipeline.talker_metrics, "omnistage_talker_active_jobs"),
    )


def _wait_stages_idle(pipeline: Pipeline) -> None:
    """The talker holds no stream and no job, the thinker no request (within a deadline)."""
    wait_for(
        lambda: _talker_busy(pipeline) == (0, 0.0),
        IDLE_DEADLINE_S,
        "the talker to free its streams",
        stage="talker",
        poll_s=0.1,
    )
    desc = lambda: _describe(pipeline.thinker_admin)  # noqa: E731
    wait_for(
        lambda: desc().running_requests + desc().queued_requests == 0,
        IDLE_DEADLINE_S,
        "the thinker to finish its requests",
        stage="thinker",
        poll_s=0.1,
    )


def _check_audio(events, tmp_path: Path) -> np.ndarray:
    """The audio chunks of one answer: in order, one `last` chunk at the end, consistent with the Finish;
    written as a WAV and read back; the samples."""
    chunks = [e.audio for e in events if e.HasField("audio")]
    assert chunks, "no audio"
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert {c.sample_rate_hz for c in chunks} == {SAMPLE_RATE_HZ}
    segments = [c.segment_index for c in chunks]
    assert segments == sorted(segments)
    status = events[-1].finish.audio
    assert status.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE and not status.code, status
    assert status.voice == "DB30" and status.sample_rate_hz == SAMPLE_RATE_HZ
    assert status.segments == segments[-1] + 1
    assert status.time_to_first_audio_ms > 0
    pcm = b"".join(c.pcm16 for c in chunks)
    assert status.samples == len(pcm) // 2
    path = tmp_path / "answer.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(chunks[0].sample_rate_hz)
        w.writeframes(pcm)
    with wave.open(str(path), "rb") as r:
        assert (r.getnchannels(), r.getsampwidth(), r.getframerate()) == (1, 2, SAMPLE_RATE_HZ)
        samples = np.frombuffer(r.readframes(r.getnframes()), "<i2")
    duration = samples.size / SAMPLE_RATE_HZ
    assert 0.2 < duration <= status.segments * MAX_SEGMENT_SECONDS, duration
    assert np.abs(samples).mean() > 30, "silence"
    return samples


def test_generate_with_audio_streams_text_and_speech_that_make_a_wav(pipeline, tmp_path):
    calls = _speak_calls(pipeline)
    with grpc.insecure_channel(pipeline.gateway) as ch:
        events = list(omni_pb2_grpc.OmniStub(ch).Generate(_spoken_request(12, "sp-1"), timeout=180))
    kinds = _kinds(events)
    assert kinds[-1] == "finish" and kinds.count("finish") == 1, kinds
    assert kinds.count("text") >= 2 and kinds.count("audio") >= 2, kinds
    assert set(kinds) == {"text", "audio", "finish"}
    assert kinds.index("text") < kinds.index("audio"), "speech before any text"
    assert {e.request_id for e in events} == {"sp-1"}
    finish = events[-1].finish
    assert finish.reason == common_pb2.FINISH_REASON_LENGTH and finish.usage.completion_tokens == 12
    # The text is what the same request without audio answers (seeded): the speech changed nothing in it.
    text_only = _spoken_request(12)
    del text_only.output_modalities[1:]
    with grpc.insecure_channel(pipeline.gateway) as ch:
        assert _tokens(omni_pb2_grpc.OmniStub(ch).Generate(text_only, timeout=60)) == _tokens(events)
    _check_audio(events, tmp_path)
    _wait_stages_idle(pipeline)
    # One Speak call, ended by the talker itself (OK), not cancelled by the gateway after its last event.
    assert _more_calls(calls, _speak_calls(pipeline)) == {"OK": 1}


def test_client_cancel_mid_speech_frees_the_talker_stream(pipeline):
    calls = _speak_calls(pipeline)
    with grpc.insecure_channel(pipeline.gateway) as ch:
        call = omni_pb2_grpc.OmniStub(ch).Generate(_spoken_request(24), timeout=180)
        for event in call:
            if event.HasField("audio"):
                break
        assert _describe(pipeline.talker_admin).running_requests == 1
        call.cancel()
    _wait_stages_idle(pipeline)
    assert _more_calls(calls, _speak_calls(pipeline)) == {"CANCELLED": 1}


def test_spoken_answers_that_end_every_way_at_once_each_end_their_speak_call(pipeline):
    """At once: two answers spoken to their end, one in a voice the talker refuses (the talker ends that
    Speak call itself), one whose client leaves at its first audio. Each Speak call ends once, with
    its own status; the module's end checks that the gateway left nothing of them to the GC."""
    calls = _speak_calls(pipeline)

    async def answers() -> list:
        async with grpc.aio.insecure_channel(pipeline.gateway) as ch:
            stub = omni_pb2_grpc.OmniStub(ch)

            async def whole(request: omni_pb2.GenerateRequest):
                events = [e async for e in stub.Generate(request, timeout=180)]
                return events[-1].finish.audio.code or "complete"

            async def refused():
                request = _spoken_request(8, "sp-refused")
                request.voice = "nobody"
                try:  # refused before its text went out: the request fails; after: only its speech
                    return await whole(request)
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name

            async def leaves():
                call = stub.Generate(_spoken_request(24, "sp-leaves"), timeout=180)
                async for event in call:
                    if event.HasField("audio"):
                        break
                call.cancel()
                return "left"

            return await asyncio.gather(
                whole(_spoken_request(8, "sp-a")), whole(_spoken_request(8, "sp-b")), refused(), leaves()
            )

    outcomes = asyncio.run(answers())
    assert outcomes == ["complete", "complete", "INVALID_ARGUMENT", "left"], outcomes
    _wait_stages_idle(pipeline)
    assert _more_calls(calls, _speak_calls(pipeline)) == {"OK": 2, "INVALID_ARGUMENT": 1, "CANCELLED": 1}


class ConverseClient:
    """A Converse call fed from a queue (the test sends turns as it reads the answers)."""

    def __init__(self, pipeline: Pipeline, config: omni_pb2.GenerateRequest, timeout: float = 180) -> None:
        self._queue: list[omni_pb2.ConverseRequest | None] = [omni_pb2.ConverseRequest(config=config)]
        self._cv = threading.Condition()
        self._channel = grpc.insecure_channel(pipeline.gateway)
        self.call = omni_pb2_grpc.OmniStub(self._channel).Converse(self._requests(), timeout=timeout)

    def _requests(self):
        while True:
            with self._cv:
                if not self._cv.wait_for(lambda: self._queue, timeout=120):
                    return  # the test stopped sending: half-close
                item = self._queue.pop(0)
            if item is None:
                return
            yield item

    def send(self, *messages: omni_pb2.ConverseRequest | None) -> None:
        with self._cv:
            self._queue.extend(messages)
            self._cv.notify()

    def close(self) -> None:
        self.send(None)
        self._channel.close()


def _converse_config(max_tokens: int) -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(
        request_id="conv",
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=3),
    )


def _turn(events, turn: int) -> list[omni_pb2.GenerateEvent]:
    return [e for e in events if e.turn == turn]


def _text_generate(pipeline: Pipeline, messages, max_tokens: int) -> list[omni_pb2.GenerateEvent]:
    request = omni_pb2.GenerateRequest(
        messages=messages,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    with grpc.insecure_channel(pipeline.gateway) as ch:
        return list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=60))


def _assistant(text: str) -> omni_pb2.ChatMessage:
    return omni_pb2.ChatMessage(role=omni_pb2.ROLE_ASSISTANT, parts=[omni_pb2.ContentPart(text=text)])


def _pcm16(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 330 * t) * 32767).astype("<i2").tobytes()


def test_converse_barge_in_interrupts_the_answer_and_frees_its_talker_stream(pipeline, tmp_path):
    """While turn 0 is being spoken the user starts speaking (turn 1, audio through the encoder): turn 0
    ends INTERRUPTED, its talker stream is freed, and turn 1 is answered from the history with the
    part of turn 0's answer that was sent."""
    calls = _speak_calls(pipeline)
    client = ConverseClient(pipeline, _converse_config(12))
    first = "Tell me a long story about the sea."
    events, sent_barge_in = [], False
    busy_at_barge_in = None
    pcm = _pcm16(1.0)
    try:
        client.send(omni_pb2.ConverseRequest(text=first))
        for event in client.call:
            events.append(event)
            if event.HasField("audio") and event.turn == 0 and not sent_barge_in:
                busy_at_barge_in = _describe(pipeline.talker_admin).running_requests
                client.send(
                    omni_pb2.ConverseRequest(
                        audio=omni_pb2.AudioChunk(pcm16=pcm[:16000], sample_rate_hz=16000)
                    ),
                    omni_pb2.ConverseRequest(
                        audio=omni_pb2.AudioChunk(pcm16=pcm[16000:], sample_rate_hz=16000)
                    ),
                    omni_pb2.ConverseRequest(end_of_turn=True),
                    None,
                )
                sent_barge_in = True
    finally:
        client.close()
    assert busy_at_barge_in == 1, "turn 0 was not being spoken"
    assert [e.turn for e in events if e.HasField("finish")] == [0, 1]
    interrupted = _turn(events, 0)[-1].finish
    assert interrupted.reason == common_pb2.FINISH_REASON_INTERRUPTED, interrupted
    assert "interrupted by user turn 1" in interrupted.message
    assert interrupted.audio.code == "CANCELLED"
    assert interrupted.audio.outcome in (omni_pb2.AUDIO_OUTCOME_PARTIAL, omni_pb2.AUDIO_OUTCOME_NONE)
    sent_audio = sum(len(e.audio.pcm16) // 2 for e in _turn(events, 0) if e.HasField("audio"))
    assert interrupted.audio.samples == sent_audio > 0
    answer = _turn(events, 1)
    assert answer[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH, answer[-1]
    _check_audio(answer, tmp_path)
    # Turn 1 is answered as a Generate of the conversation so far answers (greedy): turn 0, the part of
    # its answer that was sent, and the spoken turn as a WAV through the encoder.
    spoken = omni_pb2.ChatMessage(
        role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(audio=omni_pb2.Media(data=wav_of(pcm, 16000)))]
    )
    whole = _text_generate(pipeline, [_user(first), _assistant(_text(_turn(events, 0))), spoken], 12)
    assert whole[-1].finish.usage.prompt_tokens == answer[-1].finish.usage.prompt_tokens
    assert _tokens(whole) == _tokens(answer)
    _wait_stages_idle(pipeline)
    assert _more_calls(calls, _speak_calls(pipeline)) == {"CANCELLED": 1, "OK": 1}


def test_converse_answers_two_turns_the_second_from_the_history(pipeline, tmp_path):
    calls = _speak_calls(pipeline)
    config = _converse_config(6)
    config.system_prompt = "You are a patient assistant who answers every question kindly. " * 3
    client = ConverseClient(pipeline, config)
    first, second = "Hello there, how are you?", "And what did I just ask you?"
    events = []
    try:
        client.send(omni_pb2.ConverseRequest(text=first))
        for event in client.call:
            events.append(event)
            if event.HasField("finish") and event.turn == 0:
                client.send(omni_pb2.ConverseRequest(text=second), None)  # then half-close: the call ends
    finally:
        client.close()
    assert [e.turn for e in events if e.HasField("finish")] == [0, 1]
    answers = []
    for turn in (0, 1):
        got = _turn(events, turn)
        assert got[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH, got[-1]
        assert got[-1].finish.usage.completion_tokens == 6
        _check_audio(got, tmp_path)
        answers.append(got)
    # The second prompt repeats the first and its answer's 6 ids exactly (the history keeps them as
    # tokens): the thinker's prefix cache serves all of it that was computed (the prompt and 5 answer
    # tokens) in whole blocks of 16 (engine.block_size), most of the second prompt.
    first_usage, second_usage = answers[0][-1].finish.usage, answers[1][-1].finish.usage
    assert first_usage.cached_prompt_tokens == 0
    assert second_usage.cached_prompt_tokens == (first_usage.prompt_tokens + 5) // 16 * 16
    assert second_usage.cached_prompt_tokens > 0.6 * second_usage.prompt_tokens
    # Exactly: the first prompt, the answer's 6 ids, the new turn (the answer's text tokenized again
    # would give other ids: the random weights' tokens do not round-trip).
    tok = MingTokenizer(pipeline.root / "ckpt")
    turn = tok.encode_pieces(
        [
            ("template", "<|role_end|><role>HUMAN</role>"),
            ("text", second),
            ("template", "<|role_end|><role>ASSISTANT</role>"),
        ]
    )
    assert second_usage.prompt_tokens == first_usage.prompt_tokens + 6 + len(turn)
    _wait_stages_idle(pipeline)
    assert _more_calls(calls, _speak_calls(pipeline)) == {"OK": 2}


@pytest.fixture(autouse=True)
def talker_serving(pipeline):
    """Each test of this module starts with the talker serving: one that a test killed (`talker_killed`)
    is started again here and the gateway serves speech again (it re-admits the stage), so that the
    tests run in any order; after the last test nothing waits for a restart."""
    if pipeline.procs["talker"].poll() is not None:
        pipeline.start("talker")
        pipeline.wait_ready()


@pytest.fixture
def talker_killed(pipeline):
    """The test kills the talker; it is down after the test (`talker_serving` starts it for the next)."""
    yield
    if pipeline.procs["talker"].poll() is None:
        pipeline.kill("talker")


def test_talker_down_the_text_completes_and_the_finish_says_why_there_is_no_audio(pipeline, talker_killed):
    """It kills the talker, first in the middle of an answer's speech, then for good."""
    with grpc.insecure_channel(pipeline.gateway) as ch:
        call = omni_pb2_grpc.OmniStub(ch).Generate(_spoken_request(16), timeout=60)
        events = []
        for event in call:
            events.append(event)
            if event.HasField("audio") and pipeline.procs["talker"].poll() is None:
                pipeline.kill("talker")  # at the first audio chunk
    kinds = _kinds(events)
    assert kinds[-1] == "finish" and kinds.count("finish") == 1, kinds
    finish = events[-1].finish
    assert finish.reason == common_pb2.FINISH_REASON_LENGTH and len(_tokens(events)) == 16  # the whole text
    chunks = [e.audio for e in events if e.HasField("audio")]
    assert chunks[-1].last and not any(c.last for c in chunks[:-1])
    audio = finish.audio
    assert audio.outcome == omni_pb2.AUDIO_OUTCOME_PARTIAL and audio.code == "UNAVAILABLE", audio
    assert "talker" in audio.message and audio.samples == sum(len(c.pcm16) for c in chunks) // 2 > 0

    with grpc.insecure_channel(pipeline.gateway) as ch:  # the talker is gone: no audio at all, said so
        events = list(omni_pb2_grpc.OmniStub(ch).Generate(_spoken_request(8), timeout=60))
    kinds = _kinds(events)
    assert "audio" not in kinds and kinds[-1] == "finish", kinds
    finish = events[-1].finish
    assert finish.reason == common_pb2.FINISH_REASON_LENGTH and len(_tokens(events)) == 8
    audio = finish.audio
    assert audio.outcome == omni_pb2.AUDIO_OUTCOME_NONE and audio.code == "UNAVAILABLE", audio
    assert "talker" in audio.message

    client = ConverseClient(
        pipeline, _converse_config(4), timeout=60
    )  # Converse too: text, and why no speech
    try:
        client.send(omni_pb2.ConverseRequest(text="Are you there?"), None)
        turn = list(client.call)
    finally:
        client.close()
    assert _kinds(turn).count("finish") == 1 and "audio" not in _kinds(turn), _kinds(turn)
    assert turn[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH and len(_tokens(turn)) == 4
    assert turn[-1].finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_NONE
    assert turn[-1].finish.audio.code == "UNAVAILABLE"
    desc = _describe(pipeline.thinker_admin)
    assert desc.running_requests + desc.queued_requests == 0
