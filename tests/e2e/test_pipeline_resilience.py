"""The whole tiny pipeline under `omnistage serve` when things go wrong: overload, a slow reader, a
cancel storm, and every stage killed (SIGKILL) or stopped (SIGSTOP) after ready.

- Overload at 4x capacity: the excess is refused at once with RESOURCE_EXHAUSTED and a retry hint;
  what is admitted finishes within its deadline; nothing hangs; the services' memory stays flat.
- A client that stops reading pauses only its own request; its answer is whole when it reads again.
- A cancel storm over every path (text, speech, media input, image output) leaves no request, job,
  lease or slot behind in any stage.
- A stage killed or stopped after ready: detected within the supervision heartbeat timeout, the
  request in flight on it fails with UNAVAILABLE naming it (a talker lost mid-speech leaves the text
  whole), the launcher restarts it, and the next request through it succeeds.

One pipeline for the module; the fault tests run last (they restart stages).
"""

from __future__ import annotations

import io
import os
import re
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from omnistage.v1 import common_pb2, control_pb2, control_pb2_grpc, omni_pb2, omni_pb2_grpc
from PIL import Image

from tests.e2e.serve_pipeline import ServeProcess, capabilities_ready, free_ports, metric
from tests.waits import wait_for

pytestmark = pytest.mark.timeout(600)
START_DEADLINE_S = 300.0
RUNNING, WAITING = 2, 2  # thinker max_num_seqs; requests the gateway lets wait for a slot
HEARTBEAT_TIMEOUT_S = 4.0
STAGES = ("thinker", "encoder", "talker", "imagegen")


class Pipeline(ServeProcess):
    """`omnistage serve` of gateway + thinker + encoder + talker + imagegen, with short supervision
    timeouts and a thinker of RUNNING slots."""

    def __init__(self, root: Path, ckpt: Path) -> None:
        ports = iter(free_ports(16))
        svc = {}
        for name in STAGES + ("gateway",):
            svc[name] = {
                "kind": name,
                "port": next(ports),
                "admin_port": next(ports),
                "metrics_port": next(ports),
                "drain_grace_s": 2.0,
            }
        svc["thinker"].update(
            dist_port=next(ports),
            engine={"max_num_seqs": RUNNING, "max_num_batched_tokens": 128, "max_model_len": 512},
        )
        svc["encoder"]["encoder"] = {
            "image_max_pixels": 64 * 64,
            "video_min_pixels": 32 * 32,
            "video_total_pixels": 4 * 64 * 64,
            "max_video_frames": 4,
            "max_audio_seconds": 1.0,
            "stress_batch_sizes": [1],
        }
        svc["talker"]["talker"] = {
            "stress_batch_sizes": [2, 1],
            "max_segment_seconds": 8,
            "max_lm_tokens": 512,
        }
        svc["imagegen"].update(
            imagegen={
                "highres": 512,
                "max_side_px": 512,
                "default_side_px": 256,
                "default_steps": 2,
                "max_steps": 50,
                "stress_batch_sizes": [1],
            },
            memory={"budget_bytes": 1 << 30, "simulated_capacity_bytes": 2 << 30},
        )
        svc["gateway"]["gateway"] = {
            "admission_max_waiting": WAITING,
            "stage_health_interval_s": 0.5,
            "stage_health_timeout_s": 1.0,
            "stage_health_failures": 3,
        }
        cfg = {
            "model": {"checkpoint": str(ckpt)},
            "startup": {
                "stop_grace_s": 5.0,
                "phase_deadlines_s": {"loading_weights": 120, "profiling_memory": 120, "warming_up": 120},
            },
            "supervision": {
                "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                "health_interval_s": 0.5,
                "backoff_initial_s": 0.5,  # a restart's wait: the faults below each wait for one
                "max_restarts": 4,
            },
            "services": svc,
        }
        super().__init__(root, cfg)
        self.svc = svc
        self.gateway = f"127.0.0.1:{svc['gateway']['port']}"

    def wait_ready(self) -> Pipeline:
        super().wait_ready(START_DEADLINE_S)
        return self

    def log(self) -> str:
        return self.out.read_text()

    def pid(self, name: str) -> int:
        """The newest process of `name` rank 0 (a restart starts a new one)."""
        pids = re.findall(rf"omnistage: started {name} r0 \(pid (\d+)\)", self.log())
        assert pids, f"no {name} r0 in the launcher's output:\n{self.logs()}"
        return int(pids[-1])

    def metrics_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.svc[name]['metrics_port']}/metrics"

    def describe(self, name: str) -> control_pb2.DescribeResponse:
        with grpc.insecure_channel(f"127.0.0.1:{self.svc[name]['admin_port']}") as ch:
            return control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=5)

    def leftovers(self) -> dict[str, float]:
        """What every stage still holds: requests, jobs, leases (all 0 when the pipeline is idle)."""
        described = {n: self.describe(n) for n in STAGES + ("gateway",)}
        held = {f"{n} requests": d.running_requests + d.queued_requests for n, d in described.items()}
        held["talker jobs"] = metric(self.metrics_url("talker"), "omnistage_talker_active_jobs{")
        held["imagegen active"] = metric(self.metrics_url("imagegen"), "omnistage_imagegen_active_requests{")
        held["imagegen waiting"] = metric(
            self.metrics_url("imagegen"), "omnistage_imagegen_waiting_requests{"
        )
        held["encoder leases"] = metric(self.metrics_url("encoder"), "omnistage_encoder_leases_active{")
        held["hidden-state leases"] = metric(
            self.metrics_url("thinker"), "omnistage_thinker_hidden_state_leases_active{"
        )
        return held

    def wait_idle(self) -> None:
        last: dict[str, float] = {}

        def idle() -> bool:
            nonlocal last
            last = self.leftovers()
            return not any(last.values())

        try:
            wait_for(idle, 60, "every stage to hold nothing", poll_s=0.2)
        except Exception:
            pytest.fail(f"still held: { ({k: v for k, v in last.items() if v}) }\n{self.logs()}")

    def rss_bytes(self, name: str) -> int:
        with open(f"/proc/{self.pid(name)}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_ckpt):
    root = tmp_path_factory.mktemp("resilience")
    p = Pipeline(root, tiny_ckpt).wait_ready()
    yield p
    p.stop()


# -- requests --------------------------------------------------------------------------------------


def _png(side: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 40, 90)).save(buf, format="PNG")
    return buf.getvalue()


def text_request(max_tokens: int, text: str = "Tell me a long story.") -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=text)])],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def speech_request(max_tokens: int) -> omni_pb2.GenerateRequest:
    req = text_request(max_tokens, "Hello there, how are you?")
    req.output_modalities[:] = [omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO]
    req.sampling.temperature, req.sampling.seed = 1.0, 33
    return req


def media_request(max_tokens: int) -> omni_pb2.GenerateRequest:
    req = text_request(max_tokens, "Describe the image.")
    req.messages[0].parts.append(omni_pb2.ContentPart(image=omni_pb2.Media(data=_png())))
    return req


def image_request(steps: int, side: int = 256) -> omni_pb2.GenerateRequest:
    req = text_request(4, "Draw a lighthouse on a cliff.")
    req.output_modalities[:] = [omni_pb2.MODALITY_IMAGE]
    req.image.CopyFrom(omni_pb2.ImageOptions(width=side, height=side, steps=steps, seed=1))
    return req


# A request busy in each stage when the fault hits: long enough to be caught in flight.
REQUESTS = {
    "thinker": lambda: text_request(400),
    "encoder": lambda: media_request(8),
    "talker": lambda: speech_request(24),
    "imagegen": lambda: image_request(50),
}
# The request through the restarted stage: short, it only has to succeed (the in-flight ones above take
# 400 tokens and 50 denoising steps, CPU a check of "serves again" does not need).
AFTER = {
    "thinker": lambda: text_request(8),
    "encoder": lambda: media_request(8),
    "talker": lambda: speech_request(24),
    "imagegen": lambda: image_request(2, 64),
}


class Stream(threading.Thread):
    """One Generate call read in the background: its events, its error, when its first event came.
    `start_line`: the call is made once every stream of the barrier has connected (they arrive at once)."""

    def __init__(
        self,
        address: str,
        req: omni_pb2.GenerateRequest,
        timeout_s: float,
        start_line: threading.Barrier | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.address, self.req, self.timeout_s = address, req, timeout_s
        self.start_line = start_line
        self.events: list[omni_pb2.GenerateEvent] = []
        self.error: grpc.RpcError | None = None
        self.first = threading.Event()
        self.ended = 0.0

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            if self.start_line is not None:
                grpc.channel_ready_future(ch).result(timeout=30)
                self.start_line.wait(30)
            try:
                for event in omni_pb2_grpc.OmniStub(ch).Generate(self.req, timeout=self.timeout_s):
                    self.events.append(event)
                    self.first.set()
            except grpc.RpcError as exc:
                self.error = exc
        self.ended = time.monotonic()
        self.first.set()

    def code(self) -> grpc.StatusCode:
        return self.error.code() if self.error is not None else grpc.StatusCode.OK

    def call_here(self) -> Stream:
        """Make the call in this thread."""
        self.run()
        return self

    def result(self, join_s: float) -> Stream:
        self.join(join_s)
        assert not self.is_alive(), f"a call still running {join_s:g}s after its {self.timeout_s:g}s deadline"
        return self


def _kinds(events) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def _tokens(events) -> int:
    return sum(len(e.text.token_ids) for e in events if e.HasField("text"))


# -- overload, slow reader, cancel storm ------------------------------------------------------------


BURST_TOKENS = 64  # each admitted request's answer: it is still running when the burst's last one arrives
# (24 was too short on an idle 2-core host: the first answer ended ~1 ms before the last refusal; 48 failed 1 run in 6)


def _burst(pipeline: Pipeline, n: int, deadline_s: float) -> list[Stream]:
    """`n` requests sent at once (each connected first, then all released together)."""
    start_line = threading.Barrier(n)
    calls = [Stream(pipeline.gateway, text_request(BURST_TOKENS), deadline_s, start_line) for _ in range(n)]
    for c in calls:
        c.start()
    return [c.result(deadline_s + 30) for c in calls]


def test_overload_at_4x_capacity_refuses_the_excess_at_once_and_admitted_requests_meet_their_deadlines(
    pipeline,
):
    capacity, deadline_s = RUNNING + WAITING, 60.0
    rss = []
    for _ in range(3):  # the same burst three times: memory must not grow with it
        calls = _burst(pipeline, 4 * capacity, deadline_s)
        codes = [c.code() for c in calls]
        ok = [c for c in calls if c.code() == grpc.StatusCode.OK]
        refused = [c for c in calls if c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert len(ok) >= RUNNING and len(refused) >= 2 * capacity, codes
        for c in ok:  # admitted means finished and whole (OK: within its gRPC deadline)
            assert _kinds(c.events)[-1] == "finish" and _tokens(c.events) == BURST_TOKENS
        first_answer = min(c.ended for c in ok)
        for c in refused:  # refused at arrival, with when to come back, not after a wait: nothing streamed,
            assert not c.events and c.ended < first_answer  # and refused while the admitted ones still ran
            pushback = dict(c.error.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
            assert pushback is not None and int(pushback) > 0, c.error
        pipeline.wait_idle()
        rss.append({n: pipeline.rss_bytes(n) for n in ("gateway", "thinker")})
    for name in ("gateway", "thinker"):  # after the first burst warmed every path: flat
        assert rss[2][name] - rss[1][name] < 32 << 20, (name, rss)


def test_a_slow_reader_pauses_only_its_own_request(pipeline):
    with grpc.insecure_channel(pipeline.gateway) as ch:
        slow = omni_pb2_grpc.OmniStub(ch).Generate(speech_request(24), timeout=120)
        first = next(slow)  # then read nothing: its audio fills the flow-control window and its buffers
        others = [Stream(pipeline.gateway, text_request(16), 30) for _ in range(3)]
        time.sleep(2.0)
        for c in others:
            c.start()
        for c in others:  # the others are not held up by the reader that stopped
            assert c.result(60).code() == grpc.StatusCode.OK and _tokens(c.events) == 16
        assert slow.is_active()
        events = [first, *slow]  # reading again: the whole answer, spoken
    finish = events[-1].finish
    assert finish.reason == common_pb2.FINISH_REASON_LENGTH and _tokens(events) == 24
    assert finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE, finish.audio
    pipeline.wait_idle()


def test_a_cancel_storm_leaves_nothing_held_in_any_stage(pipeline):
    kinds = [
        lambda: text_request(200),
        lambda: speech_request(24),
        lambda: media_request(64),
        lambda: image_request(30),
    ] * 3
    cancelled = 0
    with grpc.insecure_channel(pipeline.gateway) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        calls = [stub.Generate(make(), timeout=120) for make in kinds]
        for i, call in enumerate(calls):
            if i % 2:
                try:
                    next(call)  # half of them cancelled after their first event, half before any
                except grpc.RpcError as exc:  # refused by admission: nothing to cancel
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    continue
            cancelled += call.cancel()
    assert cancelled >= RUNNING  # live calls were cancelled (the rest were refused at arrival)
    pipeline.wait_idle()
    # ...and every path still serves.
    for make, expect in (
        (lambda: text_request(4), "finish"),
        (lambda: media_request(4), "finish"),
        (lambda: image_request(1, 64), "finish"),
    ):
        call = Stream(pipeline.gateway, make(), 60).call_here()
        assert call.error is None and _kinds(call.events)[-1] == expect, call.error


# -- a stage killed or stopped after ready ------------------------------------------------------------


def _in_flight(pipeline: Pipeline, stage: str) -> Stream:
    """A request busy in `stage` (the encoder is too quick to catch inside: its call starts after)."""
    call = Stream(pipeline.gateway, REQUESTS[stage](), 120)
    call.start()
    if stage != "encoder":
        want = {"thinker": "text", "talker": "audio", "imagegen": "progress"}[stage]
        wait_for(lambda: want in _kinds(call.events) or not call.is_alive(), 60, f"a {want} event")
        assert call.is_alive(), f"the request ended before the fault: {call.error}"
    return call


# Each stage once, each signal on two of them (the other pairs take CI minutes and test the same
# supervision: the launcher's death and heartbeat paths are per process, not per stage kind).
FAULTS = [
    ("thinker", signal.SIGSTOP),
    ("encoder", signal.SIGKILL),
    ("talker", signal.SIGKILL),
    ("imagegen", signal.SIGSTOP),
]


@pytest.mark.parametrize(
    "stage, sig", FAULTS, ids=[f"{stage}-{signal.Signals(sig).name.lower()}" for stage, sig in FAULTS]
)
def test_a_stage_killed_or_stopped_after_ready_is_restarted_and_serves_again(pipeline, stage, sig):
    restarts = pipeline.log().count(f"restarting {stage} (attempt")
    pid = pipeline.pid(stage)
    if stage == "encoder":
        os.kill(pid, sig)
        call = _in_flight(pipeline, stage)
    else:
        call = _in_flight(pipeline, stage)
        os.kill(pid, sig)
    # Noticed within the heartbeat timeout (plus the polls), restarted as a whole.
    noticed = "died: killed by SIGKILL" if sig == signal.SIGKILL else "stopped answering"
    wait_for(
        lambda: f"{stage} r0 {noticed}" in pipeline.log() or f"{stage} r0 has not answered" in pipeline.log(),
        HEARTBEAT_TIMEOUT_S + 10,
        f"the launcher to notice {stage} {signal.Signals(sig).name}",
    )
    call.result(150)
    if stage == "talker":  # the text is whole; the finish says why the speech stopped
        finish = call.events[-1].finish
        assert call.error is None and finish.reason == common_pb2.FINISH_REASON_LENGTH, call.error
        assert _tokens(call.events) == 24
        assert finish.audio.code == "UNAVAILABLE" and "talker" in finish.audio.message, finish.audio
    else:
        assert call.code() == grpc.StatusCode.UNAVAILABLE, (call.code(), call.events[-1:])
        assert stage in call.error.details(), call.error.details()
    wait_for(
        lambda: pipeline.log().count(f"restarting {stage} (attempt") > restarts, 60, f"{stage} restarted"
    )
    wait_for(
        lambda: f"{stage} serving again (restart" in pipeline.log().split(f"restarting {stage} (attempt")[-1],
        180,
        f"{stage} serving again",
    )
    wait_for(
        lambda: capabilities_ready(pipeline.gateway, ["text", "media_input", "speech", "image_output"]),
        60,
        "the gateway to admit it again",
    )
    after = Stream(pipeline.gateway, AFTER[stage](), 120).call_here()
    assert _kinds(after.events)[-1] == "finish", (after.error, _kinds(after.events))
    if stage == "talker":
        assert after.events[-1].finish.audio.outcome == omni_pb2.AUDIO_OUTCOME_COMPLETE
    pipeline.wait_idle()
