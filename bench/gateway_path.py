"""The gateway's own latency, two gateways side by side on the same stages (issue 41): TTFT, time to
first audio and the gaps between streamed events, for a text and a spoken request in turn.

    python bench/gateway_path.py --other-python /tmp/base/.venv/bin/python [--requests 20]

Starts `omnistage serve` of a CPU tiny pipeline (thinker + talker, the tiny checkpoint at
.cache/tiny-ming, made when missing) with this tree's gateway, then a second gateway process of the
same deploy file from another checkout (`--other-python`: that tree's interpreter; its editable install
says which code runs) on the same stages. Requests alternate between the two gateways one at a time
(which goes first alternates too), greedy, `ignore_eos`, so both see the same stages in the same state.
Prints a markdown table per gateway (p50 / p95 in ms): TTFT and per-delta gap of text requests, TTFT,
TTFA and per-chunk gap of spoken ones; writes OUT/gateway_path.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnistage.common.bench_results import write_result  # noqa: E402
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc  # noqa: E402

from load_tests.chaos_launch import free_ports  # noqa: E402
from load_tests.pipeline_load import pipeline  # noqa: E402

_START_S = 900.0


def deploy(ckpt: Path) -> tuple[dict, dict]:
    """(the deploy file `serve` runs: thinker, talker and this tree's gateway; the same with the other
    tree's gateway on its own ports, which that process reads)."""
    ports = iter(free_ports(14))
    thinker = {
        "kind": "thinker",
        "port": next(ports),
        "admin_port": next(ports),
        "metrics_port": next(ports),
        "dist_port": next(ports),
        "device": "cpu",
        "dtype": "float32",
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 1024},
    }
    talker = {
        "kind": "talker",
        "port": next(ports),
        "admin_port": next(ports),
        "metrics_port": next(ports),
        "device": "cpu",
        "dtype": "float32",
        "talker": {"stress_batch_sizes": [2, 1], "max_segment_seconds": 20, "max_lm_tokens": 512},
    }

    def gateway() -> dict:
        return {
            "kind": "gateway",
            "port": next(ports),
            "admin_port": next(ports),
            "metrics_port": next(ports),
        }

    base = {
        "version": 1,
        "host": "127.0.0.1",
        "model": {"checkpoint": str(ckpt)},
        "startup": {"phase_deadlines_s": {p: 600 for p in ("starting", "loading_weights", "warming_up")}},
        "services": {"thinker": thinker, "talker": talker, "gateway": gateway()},
    }
    other = {**base, "services": {**base["services"], "gateway": gateway()}}  # one gateway per deploy file
    return base, other


def speech_ready(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="omnistage.v1.Omni.speech"), timeout=2
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def request(i: int, spoken: bool, tokens: int) -> omni_pb2.GenerateRequest:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=f"Question {i}?")])
    outputs = [omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO] if spoken else [omni_pb2.MODALITY_TEXT]
    sampling = common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, seed=i)
    return omni_pb2.GenerateRequest(
        request_id=f"bench-{i}", messages=[msg], output_modalities=outputs, sampling=sampling
    )


def timed(stub: omni_pb2_grpc.OmniStub, req: omni_pb2.GenerateRequest) -> dict:
    """TTFT, TTFA (ms) and the gaps between text deltas / audio chunks (ms) of one request."""
    start = time.perf_counter()
    text_at: list[float] = []
    audio_at: list[float] = []
    finish = None
    for event in stub.Generate(req, timeout=300):
        now = (time.perf_counter() - start) * 1000
        kind = event.WhichOneof("event")
        if kind == "text":
            text_at.append(now)
        elif kind == "audio" and event.audio.pcm16:
            audio_at.append(now)
        elif kind == "finish":
            finish = event.finish
    return {
        "ttft": text_at[0] if text_at else None,
        "ttfa": audio_at[0] if audio_at else None,
        "text_gaps": [b - a for a, b in zip(text_at, text_at[1:], strict=False)],
        "audio_gaps": [b - a for a, b in zip(audio_at, audio_at[1:], strict=False)],
        "audio": omni_pb2.AudioOutcome.Name(finish.audio.outcome)
        if finish and finish.HasField("audio")
        else "",
    }


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q / 100 * len(values)))], 1)


def summary(records: list[dict]) -> dict:
    out: dict = {}
    for kind in ("text", "speech"):
        rs = [r for r in records if r["kind"] == kind]
        for key, values in (
            ("ttft", [r["ttft"] for r in rs if r["ttft"] is not None]),
            ("ttfa", [r["ttfa"] for r in rs if r["ttfa"] is not None]),
            ("text_gap", [g for r in rs for g in r["text_gaps"]]),
            ("audio_gap", [g for r in rs for g in r["audio_gaps"]]),
        ):
            if values:
                out[f"{kind}_{key}_p50_ms"] = pct(values, 50)
                out[f"{kind}_{key}_p95_ms"] = pct(values, 95)
                out[f"{kind}_{key}_mean_ms"] = round(statistics.fmean(values), 1)
        out[f"{kind}_audio"] = sorted({r["audio"] for r in rs})
    return out


def start_other(python: str, cfg: Path, name: str, log: Path, env: dict) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - the process's output, closed with it
    return subprocess.Popen(
        [python, "-m", "omnistage.services.gateway", "--config", str(cfg), "--service", name],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
    )


def wait(what: str, ok, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + _START_S
    while not ok():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            tails = "\n".join(f"== {log}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
            raise SystemExit(f"{what} did not come up:\n{tails}")
        time.sleep(1.0)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def measure(addresses: dict[str, str], n: int, tokens: int) -> dict[str, list[dict]]:
    records: dict[str, list[dict]] = {name: [] for name in addresses}
    channels = {name: grpc.insecure_channel(a) for name, a in addresses.items()}
    stubs = {name: omni_pb2_grpc.OmniStub(ch) for name, ch in channels.items()}
    names = list(addresses)
    for name in names:  # first-call costs, unmeasured
        for spoken in (False, True):
            timed(stubs[name], request(0, spoken, tokens))
    for i in range(n):
        order = names if i % 2 == 0 else names[::-1]
        for spoken in (False, True):
            for name in order:
                rec = timed(stubs[name], request(i + 1, spoken, tokens))
                records[name].append({"kind": "speech" if spoken else "text", **rec})
        print(f"round {i + 1}/{n}", flush=True)
    for ch in channels.values():
        ch.close()
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other-python", required=True, help="the other checkout's python (its venv's)")
    ap.add_argument("--other-name", default="other", help="how the table names the other gateway")
    ap.add_argument("--this-name", default="this", help="how the table names this tree's gateway")
    ap.add_argument("--requests", type=int, default=20, help="rounds (a text and a spoken request each)")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per answer")
    ap.add_argument(
        "--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results" / "cpu")
    )  # a CPU comparison: never beside the GPU records
    args = ap.parse_args()
    ckpt = ROOT / ".cache" / "tiny-ming"
    if not (ckpt / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "omnistage.common.cli", "make-tiny-checkpoint", str(ckpt)], check=True
        )
    with tempfile.TemporaryDirectory(prefix="gateway-path-") as tmp:
        served, both = deploy(ckpt)
        serve_cfg, both_cfg = Path(tmp) / "serve.yaml", Path(tmp) / "both.yaml"
        serve_cfg.write_text(yaml.safe_dump(served))
        both_cfg.write_text(yaml.safe_dump(both))
        logs = [Path(tmp) / "serve.log", Path(tmp) / "other.log"]
        addr = {
            args.this_name: f"127.0.0.1:{served['services']['gateway']['port']}",
            args.other_name: f"127.0.0.1:{both['services']['gateway']['port']}",
        }
        # One stage key for both gateways: the stages take calls from the deployment's processes only.
        os.environ["OMNISTAGE_STAGE_KEY"] = secrets.token_urlsafe(32)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with pipeline(str(serve_cfg), [], logs[0]):
            wait("the pipeline's speech", lambda: speech_ready(addr[args.this_name]), [], logs)
            other = start_other(args.other_python, both_cfg, "gateway", logs[1], env)
            try:
                wait("the other gateway", lambda: speech_ready(addr[args.other_name]), [other], logs)
                records = measure(addr, args.requests, args.tokens)
            finally:
                stop(other)
    data = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["bench/gateway_path.py", *sys.argv[1:]]),
        "rounds": args.requests,
        "tokens": args.tokens,
        "gateways": {name: summary(rs) for name, rs in records.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "gateway_path.json", data, gpu=False)  # a CPU comparison of two gateways
    print(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
