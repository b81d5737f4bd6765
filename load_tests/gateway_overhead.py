"""Latency the gateway adds over calling the thinker directly (p50/p95), on the tiny CPU pipeline.

python load_tests/gateway_overhead.py [--requests 100] [--max-tokens 8] [--config deploy/local-tiny.yaml]

Starts `omnistage serve`, then alternates identical greedy requests to `Thinker.Generate` (with the
prompt the gateway would build) and `Omni.Generate`, one at a time, timing time-to-first-event and
time-to-finish on the client. Prints a markdown table; stops the pipeline.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from omnistage.common.config import load_config
from omnistage.services.gateway.prompt import Turn, build_chat
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc, thinker_pb2, thinker_pb2_grpc

TEXT = "How far is the moon?"


def _timed(call) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    for _ in call:
        if first is None:
            first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="deploy/local-tiny.yaml")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    cfg = load_config(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage.common.cli", "serve", args.config, "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        try:
            deadline = time.monotonic() + 300
            while not (ready.exists() and ready.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("pipeline did not start")
                time.sleep(0.2)
            gateway = ready.read_text().strip()
            thinker = cfg.address(cfg.services_of("thinker")[0].name)
            sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            omni_req = omni_pb2.GenerateRequest(
                messages=[
                    omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=TEXT)])
                ],
                sampling=sampling,
            )
            th_req = thinker_pb2.ThinkerRequest(chat=build_chat([Turn("user", TEXT)]), sampling=sampling)
            res = {"thinker": ([], []), "gateway": ([], [])}
            with grpc.insecure_channel(gateway) as gch, grpc.insecure_channel(thinker) as tch:
                omni, th = omni_pb2_grpc.OmniStub(gch), thinker_pb2_grpc.ThinkerStub(tch)
                for _ in range(5):  # warm both paths
                    _timed(omni.Generate(omni_req, timeout=60))
                    _timed(th.Generate(th_req, timeout=60))
                for _ in range(args.requests):
                    for name, call in (
                        ("thinker", lambda: th.Generate(th_req, timeout=60)),
                        ("gateway", lambda: omni.Generate(omni_req, timeout=60)),
                    ):
                        first, total = _timed(call())
                        res[name][0].append(first)
                        res[name][1].append(total)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"\n{args.requests} sequential requests per path, {args.max_tokens} tokens each, tiny CPU pipeline")
    print("| path | first event p50 / p95 (ms) | whole request p50 / p95 (ms) |")
    print("|---|---|---|")
    for name, (first, total) in res.items():
        print(
            f"| {name} | {_pct(first, 0.5):.2f} / {_pct(first, 0.95):.2f} | {_pct(total, 0.5):.2f} / {_pct(total, 0.95):.2f} |"
        )
    added = [g - t for g, t in zip(res["gateway"][1], res["thinker"][1], strict=True)]
    print(
        f"| added by the gateway (paired) | | {statistics.median(added) * 1000:.2f} / {_pct(added, 0.95):.2f} |"
    )


if __name__ == "__main__":
    main()
