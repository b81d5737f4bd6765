"""Speech under load through the public API: Omni.Generate with text + audio at rising concurrency.

python load_tests/speech_load.py [--config deploy/local-tiny.yaml] [--set KEY.PATH=VALUE ...]
                                 [--address HOST:PORT] [--concurrency 1,2,4,8,16] [--rounds 2] [--max-tokens 12]

Starts `omnistage serve` (or uses the gateway at --address), then for each concurrency c runs
max(4, rounds·c) identical greedy requests (seed i for the talker's noise) from c client threads, each
asking for MODALITY_TEXT + MODALITY_AUDIO, and times on the client:
  TTFA   time from sending the request to its first audio chunk with samples
  RTF    (time of the last audio chunk − time of the first) / seconds of audio received, per spoken
         request (< 1: the speech streams faster than it plays)
  req/s  requests finished per second of the level's wall time (spoken or not)
Requests above the talker's stream cap wait in the gateway for a stream (within their deadline) and
are then spoken; the table says how many were spoken. Prints a markdown table; stops the pipeline it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

TEXT = "Hello there, how are you?"


@dataclass
class Result:
    ttfa_s: float | None  # None: no audio
    rtf: float | None
    audio_s: float
    wall_s: float
    outcome: str  # AudioOutcome name, with the code when not complete


def _one(stub: omni_pb2_grpc.OmniStub, seed: int, max_tokens: int, timeout_s: float) -> Result:
    request = omni_pb2.GenerateRequest(
        request_id=f"speech-load-{seed}",
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=TEXT)])],
        output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
        sampling=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=seed
        ),
    )
    start = time.perf_counter()
    first = last = None
    samples, rate, finish = 0, 0, None
    for event in stub.Generate(request, timeout=timeout_s):
        kind = event.WhichOneof("event")
        if kind == "audio" and event.audio.pcm16:
            last = time.perf_counter()
            first = first or last
            samples += len(event.audio.pcm16) // 2
            rate = event.audio.sample_rate_hz
        elif kind == "finish":
            finish = event.finish
    wall = time.perf_counter() - start
    if finish is None:
        raise RuntimeError("stream ended without a Finish")
    audio_s = samples / rate if rate else 0.0
    status = finish.audio
    outcome = omni_pb2.AudioOutcome.Name(status.outcome).removeprefix("AUDIO_OUTCOME_")
    if status.code:
        outcome += f" {status.code}"
    rtf = (last - first) / audio_s if first is not None and audio_s else None
    return Result(first - start if first is not None else None, rtf, audio_s, wall, outcome)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_level(
    address: str, concurrency: int, requests: int, max_tokens: int, timeout_s: float
) -> tuple[list[Result], float]:
    results: list[Result] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    seeds = iter(range(requests))

    def worker() -> None:
        with grpc.insecure_channel(address) as ch:
            stub = omni_pb2_grpc.OmniStub(ch)
            while True:
                with lock:
                    seed = next(seeds, None)
                if seed is None:
                    return
                try:
                    r = _one(stub, seed, max_tokens, timeout_s)
                except Exception as exc:  # noqa: BLE001 - reported after the level
                    with lock:
                        errors.append(exc)
                    continue
                with lock:
                    results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"concurrency {concurrency}: {len(errors)} requests failed, first: {errors[0]!r}")
    return results, wall


def row(concurrency: int, results: list[Result], wall: float) -> str:
    spoken = [r for r in results if r.ttfa_s is not None]
    outcomes = Counter(r.outcome for r in results)
    if spoken:
        ttfa = [r.ttfa_s * 1000 for r in spoken]
        rtf = [r.rtf for r in spoken if r.rtf is not None]
        timing = (
            f"{_pct(ttfa, 0.5):.0f} | {_pct(ttfa, 0.95):.0f} | {_pct(rtf, 0.5):.2f} | {_pct(rtf, 0.95):.2f} | "
            f"{sum(r.audio_s for r in spoken) / len(spoken):.2f}"
        )
    else:
        timing = "– | – | – | – | –"
    detail = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
    return (
        f"| {concurrency} | {len(results)} | {len(spoken)} | {timing} | {len(results) / wall:.2f} | "
        f"{_pct([r.wall_s for r in results], 0.5):.2f} | {detail} |"
    )


def _serve(config: str, overrides: list[str], tmp: Path) -> tuple[subprocess.Popen, str]:
    ready = tmp / "ready"
    cmd = [sys.executable, "-m", "omnistage.common.cli", "serve", config, "--ready-file", str(ready)]
    for o in overrides:
        cmd += ["--set", o]
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 - lives as long as the pipeline
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    deadline = time.monotonic() + 600
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"pipeline did not start:\n{(tmp / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, ready.read_text().strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deploy/local-tiny.yaml")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="passed to `omnistage serve` (repeatable)",
    )
    ap.add_argument("--address", default="", help="use this running gateway instead of starting one")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=2, help="requests per level: max(4, rounds x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="speech-load-") as tmp:
        proc, address = (
            (None, args.address) if args.address else _serve(args.config, args.overrides, Path(tmp))
        )
        try:
            _one(
                omni_pb2_grpc.OmniStub(grpc.insecure_channel(address)), 0, args.max_tokens, args.timeout_s
            )  # warm
            print(
                "| concurrency | requests | spoken | TTFA p50 ms | TTFA p95 ms | RTF p50 | RTF p95 | audio s/req "
                "| req/s | wall p50 s | Finish.audio |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for c in levels:
                results, wall = run_level(
                    address, c, max(4, args.rounds * c), args.max_tokens, args.timeout_s
                )
                print(row(c, results, wall), flush=True)
        except BaseException:
            if proc is not None:
                print(
                    f"--- omnistage serve (last lines) ---\n{(Path(tmp) / 'serve.log').read_text()[-6000:]}",
                    file=sys.stderr,
                )
            raise
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
