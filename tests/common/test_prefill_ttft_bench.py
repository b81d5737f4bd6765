"""bench/prefill_ttft.py: rows carry the issue's keys from the samples (client TTFT, the prompt and
cached tokens the Finish reported, prompt tokens per second), the breakdown adds up from histogram
deltas, the wrapper picks the CPU dry run without GPUs, and a dry run never writes the GPU file."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "load_tests"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cases():
    return load("prefill_cases")


@pytest.fixture(scope="module")
def bench():
    return load("prefill_ttft")


def sample(cases, ttft: float, prompt: int, cached: int, code: str = "OK"):
    return cases.Sample(
        start=0.0, ttft_s=ttft, end=1.0, prompt_tokens=prompt, cached_tokens=cached, code=code
    )


def test_a_row_has_the_issues_keys_from_the_samples(cases):
    samples = [
        sample(cases, 0.1, 1050, 0),
        sample(cases, 0.2, 1050, 0),
        sample(cases, 0.0, 0, 0, "UNAVAILABLE"),
    ]
    samples[-1].ttft_s = None
    row = cases.row("prompt_1k", 1, samples, "triton")
    assert set(cases.ROW_KEYS) <= set(row)
    assert (row["case"], row["backend"], row["prompt_tokens"], row["cached_tokens"]) == (
        "prompt_1k",
        "triton",
        1050,
        0,
    )
    assert row["ttft_p50_ms"] == pytest.approx(150.0) and row["ttft_p95_ms"] == pytest.approx(195.0)
    assert row["prompt_tok_s"] == pytest.approx(7875.0)  # c = 1: the median of 10500 and 5250 tok/s
    assert row["errors"] == 1 and row["errors_by_status"] == {"UNAVAILABLE": 1}


def test_a_burst_row_counts_new_tokens_over_the_longest_first_token(cases):
    samples = [sample(cases, 0.1, 60, 16), sample(cases, 0.4, 60, 0)]
    row = cases.row("text_c8", 8, samples, "flashinfer", decode_tok_s=700.0)
    assert row["prompt_tok_s"] == pytest.approx((44 + 60) / 0.4) and row["decode_tok_s"] == 700.0


def test_inter_token_gaps_are_per_stream(cases):
    a, b = cases.Sample(deltas=[1.0, 1.01, 1.03]), cases.Sample(deltas=[5.0, 5.5])
    assert [round(g, 3) for g in cases.inter_token_gaps([a, b])] == [0.01, 0.02, 0.5]


def test_the_breakdown_adds_up_from_histogram_deltas(bench):
    def page(n: int, gw: float, adm: float, eng: float, queue: float, phase: float) -> dict:
        out = {
            'omnistage_gateway_ttft_seconds_sum{method="Generate",service="gateway"}': gw,
            'omnistage_gateway_ttft_seconds_count{method="Generate",service="gateway"}': n,
            'omnistage_gateway_admission_wait_seconds_sum{service="gateway"}': adm,
            'omnistage_gateway_admission_wait_seconds_count{service="gateway"}': n,
            'omnistage_thinker_ttft_seconds_sum{service="thinker"}': eng,
            'omnistage_thinker_ttft_seconds_count{service="thinker"}': n,
            'omnistage_thinker_queue_time_seconds_sum{service="thinker"}': queue,
            'omnistage_thinker_queue_time_seconds_count{service="thinker"}': n,
        }
        for p in bench.PHASES:
            out[
                f'omnistage_thinker_step_phase_seconds_sum{{phase="{p}",service="thinker",step="prefill"}}'
            ] = phase
            out[
                f'omnistage_thinker_step_phase_seconds_count{{phase="{p}",service="thinker",step="prefill"}}'
            ] = n
        return out

    before = page(3, 1.0, 0.0, 0.5, 0.01, 0.1)
    after = page(13, 1.0 + 10 * 0.060, 0.010, 0.5 + 10 * 0.040, 0.01 + 10 * 0.001, 0.1 + 10 * 0.005)
    b = bench.breakdown(before, after, client_ms=70.0, engine_ms=None)
    assert b["gateway_ttft_ms"] == pytest.approx(60.0) and b["engine_ttft_ms"] == pytest.approx(40.0)
    assert b["client_to_gateway_ms"] == pytest.approx(10.0)
    assert b["gateway_admission_wait_ms"] == pytest.approx(1.0)
    assert b["gateway_to_engine_ms"] == pytest.approx(19.0)  # 60 - 1 (admission) - 40 (engine)
    assert b["prefill_step_launch_ms"] == pytest.approx(5.0) and b["engine_queue_ms"] == pytest.approx(1.0)
    assert b["engine_other_ms"] == pytest.approx(40.0 - 1.0 - len(bench.PHASES) * 5.0)  # every phase 5 ms


def test_a_dry_run_never_writes_the_gpu_result_file(bench, monkeypatch):
    monkeypatch.setattr(bench, "device_name", lambda: "cpu (x86_64, 2 cores)")
    args = bench.parse_args(["--out", "/tmp/x"])
    assert args.results == "prefill_ttft.dry.json" and args.backends == ["auto"]
    monkeypatch.setattr(bench, "device_name", lambda: "2 x NVIDIA H200")
    args = bench.parse_args([])
    assert args.results == "prefill_ttft.json" and args.backends == ["triton", "flashinfer"]
    assert bench.parse_args(["--tiny"]).results == "prefill_ttft.dry.json"
    assert bench.parse_args(["--profile"]).cases == ["short"] and bench.parse_args([]).cases == ["*"]


def test_the_wrapper_runs_the_cpu_tiny_plan_without_gpus(tmp_path):
    """Without nvidia-smi the wrapper picks deploy/local-tiny.yaml, --tiny and free ports (its dry parse)."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    wrapper = ROOT / "bench" / "prefill_ttft.sh"
    out = subprocess.run(
        ["bash", str(wrapper), "--cases", "short"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PY": str(fake), "OUT": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("bench/prefill_ttft.py --config deploy/local-tiny.yaml") and "--tiny" in last
    assert "--free-ports" in last and "--cases short" in last and wrapper.stat().st_mode & 0o111


# --- the HTTP client (short_http) against a canned stream of the front ------------------------------

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 60, "completion_tokens": 4}}


def chunk(content: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


@pytest.fixture
def front():
    """A local HTTP server answering every POST with the SSE data objects in `front.chunks`."""
    import http.server
    import json
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        chunks: list[dict] = []

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for obj in self.chunks:
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


def http_sample(cases, front, chunks: list[dict]):
    front.RequestHandlerClass.chunks = chunks
    return cases.http_chat("127.0.0.1", front.server_address[1], "hi", 4, 30.0)


def test_an_http_answer_whose_tokens_have_no_text_yet_is_timed_not_an_error(cases, front):
    """The tiny model's greedy tokens are often a special token or part of a UTF-8 character: the
    front's chunks then carry no content (one short_http run in four failed with 2 'errors', all OK)."""
    s = http_sample(cases, front, [ROLE, chunk(""), chunk("", "length"), USAGE])
    assert (s.code, s.ok, s.completion_tokens, s.deltas) == ("OK", True, 4, [])
    assert 0 < s.ttft_s <= s.end - s.start  # timed to the first chunk: the front's first token


def test_an_http_answer_with_text_is_timed_from_its_first_chunk(cases, front):
    s = http_sample(cases, front, [ROLE, chunk("a"), chunk("b", "length"), USAGE])
    assert s.ok and len(s.deltas) == 2 and s.ttft_s <= s.deltas[0] - s.start


@pytest.mark.parametrize(
    "chunks, code",
    [
        (
            [
                ROLE,
                {"error": {"message": "thinker rank 1 died", "type": "server_error", "code": "unavailable"}},
            ],
            "SSE_unavailable",
        ),
        ([ROLE, chunk("a")], "NO_FINISH"),
    ],
    ids=["error-in-stream", "no-usage"],
)
def test_an_http_stream_that_fails_after_its_status_is_an_error_naming_why(cases, front, chunks, code):
    s = http_sample(cases, front, chunks)
    assert s.code == code and not s.ok
    assert s.detail == ("thinker rank 1 died" if code == "SSE_unavailable" else "")
