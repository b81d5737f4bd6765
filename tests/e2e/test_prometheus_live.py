"""The dashboard and the alert rules against a real Prometheus scraping the CPU tiny pipeline under load.

The pipeline is the full tiny one the e2e tests share (tests/e2e/full_pipeline.py: every stage, an
image stage with a memory budget so the ledger has one to show; a start of its own cost ~35 s of CPU).
Debian's `prometheus` scrapes every service's /metrics each second and evaluates `alerts.yml`. Text,
speech, image-output and media-input (an image and an audio clip) requests go through the gateway at
once, with one the client cancels, one that is invalid and one refused for its deadline. Then every
expression of the Grafana dashboard must parse and return data, every stage's queue-time histogram must
have counted, every alert rule must parse and be loaded healthy, every service's /metrics must pass
`promtool check metrics`, and every metric a service exports must be documented in docs/metrics.md.
Without `prometheus` on PATH the test fails (`make test` unpacks it into .tools/,
deploy/test-tools.sh), as tests/deploy does.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import wave
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from omnistage.common.runtime.auth import bearer
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc
from PIL import Image

from tests.e2e import full_pipeline
from tests.e2e.full_pipeline import KEY, SERVICES
from tests.e2e.serve_pipeline import free_ports

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/omnistage.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
DOCS = ROOT / "docs/metrics.md"
DATA_DEADLINE_S = 30.0
AUTH = bearer(KEY)
BURST = full_pipeline.MAX_IN_FLIGHT + 4  # text requests at once: past the gateway's limit


class Prometheus:
    """A `prometheus` process scraping `targets` (service → metrics port) every second."""

    def __init__(self, root: Path, targets: dict[str, int]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:  # `make test` unpacks Debian's into .tools/bin: absent means CI is broken
            pytest.fail("prometheus not found: run deploy/test-tools.sh (`make test` does)")
        (port,) = free_ports(1)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {
                    "job_name": f"omnistage-{name}",
                    "static_configs": [{"targets": [f"127.0.0.1:{mport}"], "labels": {"stage": name}}],
                }
                for name, mport in targets.items()
            ],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{port}"
        self.log = root / "prometheus.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={root / 'prometheus.yml'}",
                    f"--storage.tsdb.path={root / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:  # a bad query is a 400 with the error in the body
            return json.loads(exc.read())

    def query(self, expr: str) -> dict:
        return self.get("/api/v1/query", query=expr)

    def wait_ready(self, deadline_s: float = 30.0) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2)
                return
            except OSError:
                time.sleep(0.2)
        pytest.fail(f"prometheus did not become ready:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of the dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", []) if t.get("expr")]


def alert_exprs() -> list[tuple[str, str]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in groups for r in g["rules"]]


def _text(text: str, max_tokens: int = 8, **kw) -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=text)])],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1),
        **kw,
    )


def _png(side: int = 48) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (30, 120, 200)).save(buf, format="PNG")
    return buf.getvalue()


def _wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * rate)) / rate) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(tone.tobytes())
    return buf.getvalue()


def _media(max_tokens: int = 4) -> omni_pb2.GenerateRequest:
    """Text with an image and an audio clip: the encoder's work (and its queue time)."""
    parts = [
        omni_pb2.ContentPart(image=omni_pb2.Media(data=_png())),
        omni_pb2.ContentPart(audio=omni_pb2.Media(data=_wav())),
        omni_pb2.ContentPart(text="What do you see and hear?"),
    ]
    return omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=parts)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1),
    )


def _send_load(gateway: str, gateway_metrics: int) -> dict[str, str]:
    """A request the client cancels; then text, speech, image and media-input requests at once with an
    invalid one; then a burst of text requests past the gateway's limit (BURST: the refusals' panel). The
    outcome (status name) of each."""
    mixed = {
        "media": _media(),
        "speech": _text(
            "Say hello.", 12, output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO]
        ),
        "image": _text(
            "Draw a cat.",
            4,
            output_modalities=[omni_pb2.MODALITY_IMAGE],
            image=omni_pb2.ImageOptions(width=64, height=64, steps=2, seed=1),
        ),
        "invalid": omni_pb2.GenerateRequest(
            messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Hi")])],
            sampling=common_pb2.SamplingParams(temperature=-1.0),
        ),
        **{f"text-{i}": _text(f"Tell me about {i}.", 16) for i in range(2)},
    }
    burst = {f"burst-{i}": _text(f"Count to {i}.", 32) for i in range(BURST)}
    # The burst's calls are connected first, then released together: sent one by one as each channel
    # connected, the first answers ended before the last arrived (never past the limit on an idle host).
    start_line = threading.Barrier(BURST)

    def run(request: omni_pb2.GenerateRequest | None, together: bool = False) -> str:
        with grpc.insecure_channel(gateway) as channel:
            stub = omni_pb2_grpc.OmniStub(channel)
            if together:
                grpc.channel_ready_future(channel).result(timeout=30)
                start_line.wait(30)
            try:
                if request is None:  # cancelled by the client after its first event
                    call = stub.Generate(_text("A long answer, please.", 64), timeout=60, metadata=AUTH)
                    next(call)
                    call.cancel()
                    return "CANCELLED"
                events = list(stub.Generate(request, timeout=120, metadata=AUTH))
                if omni_pb2.MODALITY_AUDIO not in request.output_modalities:
                    return "OK"
                audio = events[-1].finish.audio  # the spoken answer's speech, as the finish tells it
                outcome = omni_pb2.AudioOutcome.Name(audio.outcome).removeprefix("AUDIO_OUTCOME_")
                return f"OK audio {outcome} {audio.code} {audio.message}".strip()
            except grpc.RpcError as exc:
                return exc.code().name

    outcomes = {"cancelled": run(None)}
    _wait_released(gateway_metrics)  # else the mixed wave may find the cancelled request's place taken
    with concurrent.futures.ThreadPoolExecutor(len(burst)) as pool:
        for wave in (mixed, burst):
            futures = {name: pool.submit(run, request, wave is burst) for name, request in wave.items()}
            outcomes.update({name: f.result() for name, f in futures.items()})
    # The random-weight model's answer may hold nothing speakable (then no audio, no TTFA): a few
    # other seeds, each outcome kept for the assertion's message.
    for seed in (2, 3, 4):
        if outcomes["speech"].startswith("OK audio COMPLETE"):
            break
        mixed["speech"].sampling.seed = seed
        outcomes[f"speech-seed-{seed - 1}"] = outcomes["speech"]
        outcomes["speech"] = run(mixed["speech"])
    return outcomes


@pytest.fixture(scope="module")
def live(tmp_path_factory, shared_pipeline):
    targets = {name: shared_pipeline["ports"][name]["metrics_port"] for name in SERVICES}
    prometheus = Prometheus(tmp_path_factory.mktemp("prometheus-live"), targets)
    try:
        prometheus.wait_ready()
        outcomes = _send_load(shared_pipeline["grpc"], targets["gateway"])
        yield prometheus, targets, outcomes
    finally:
        prometheus.stop()


def _wait_released(metrics_port: int, deadline_s: float = 30.0) -> None:
    """Until the gateway's /metrics shows no request holding or awaiting a stage's slot (the cancelled
    call released its place); a failure naming what it still counts after `deadline_s`."""
    gauges = ("omnistage_gateway_admission_running{", "omnistage_gateway_admission_waiting{")
    deadline, busy = time.monotonic() + deadline_s, []
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        busy = [
            line
            for line in text.splitlines()
            if line.startswith(gauges) and float(line.rsplit(" ", 1)[1]) != 0
        ]
        if not busy:
            return
        time.sleep(0.1)
    pytest.fail(f"the gateway still counts requests at its stages after {deadline_s}s: {busy}")


def _missing_data(prometheus: Prometheus, exprs: list[tuple[str, str]]) -> list[str]:
    missing = []
    for title, expr in exprs:
        answer = prometheus.query(expr)
        if answer.get("status") != "success":
            missing.append(f"{title}: {expr}: {answer.get('error')}")
        elif not answer["data"]["result"]:
            missing.append(f"{title}: {expr}: no data")
    return missing


def test_every_dashboard_query_parses_and_returns_data(live):
    prometheus, _, outcomes = live
    assert outcomes["image"] == outcomes["media"] == outcomes["text-0"] == "OK", outcomes
    assert outcomes["speech"] == "OK audio COMPLETE", outcomes  # else no TTFA reaches the dashboard
    assert outcomes["invalid"] == "INVALID_ARGUMENT" and outcomes["cancelled"] == "CANCELLED", outcomes
    burst = [outcome for name, outcome in outcomes.items() if name.startswith("burst-")]
    assert "RESOURCE_EXHAUSTED" in burst, outcomes  # past the gateway's limit: the refusals' data
    exprs = dashboard_exprs()
    assert len(exprs) > 30
    deadline = time.monotonic() + DATA_DEADLINE_S  # the load's last counts reach two scrapes (rate())
    while (missing := _missing_data(prometheus, exprs)) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert not missing, "dashboard queries without data:\n" + "\n".join(missing) + f"\n(load: {outcomes})"


def test_every_stage_counts_its_queue_time_under_the_load(live):
    """The dashboard's queue-time panel shows real waits: each stage's histogram counted the load's
    requests (its series exist at 0 from the start, so "data" alone would not tell)."""
    prometheus, _, outcomes = live
    stages = ("thinker", "encoder", "talker", "imagegen")
    deadline = time.monotonic() + DATA_DEADLINE_S
    while True:
        counted = {
            s: prometheus.query(f"sum(omnistage_{s}_queue_time_seconds_count)")["data"]["result"]
            for s in stages
        }
        empty = [s for s, r in counted.items() if not r or float(r[0]["value"][1]) == 0]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert not empty, f"no queue time counted by {empty} (load: {outcomes})"


def test_every_alert_rule_parses_and_is_loaded_healthy(live):
    prometheus, _, _ = live
    for name, expr in alert_exprs():
        answer = prometheus.query(expr)
        assert answer.get("status") == "success", f"{name}: {expr}: {answer.get('error')}"
    deadline = time.monotonic() + 10
    while True:
        rules = [r for g in prometheus.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        unhealthy = [
            (r["name"], r.get("health"), r.get("lastError")) for r in rules if r.get("health") != "ok"
        ]
        if not unhealthy or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {r["name"] for r in rules} == {name for name, _ in alert_exprs()}
    assert not unhealthy, unhealthy
    firing = prometheus.query(
        'ALERTS{alertname=~"OmnistageStageDown|OmnistageStageFailed|OmnistageMemoryOverBudget"}'
    )
    assert firing["data"]["result"] == [], firing  # a healthy pipeline under light load raises none of these


def test_every_exported_metric_is_documented_and_passes_promtool(live, check_metrics):
    _, targets, _ = live
    documented = set(re.findall(r"`(omnistage_[a-z0-9_]+)`", DOCS.read_text()))
    undocumented = {}
    for name, port in targets.items():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        check_metrics(text)
        families = {
            f
            for f in re.findall(r"^# TYPE (omnistage_[a-z0-9_]+) ", text, re.M)
            if not f.endswith("_created")
        }  # prometheus_client's creation timestamps
        if families - documented:  # the text format names a counter's family with its _total
            undocumented[name] = sorted(families - documented)
    assert not undocumented, f"exported but not in docs/metrics.md: {undocumented}"
