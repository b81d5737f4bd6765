"""`make demo`: start the whole pipeline, send one real request per modality built so far, save, stop.

Runs `omnistage serve` as a child (so the demo exercises exactly what a user runs), waits for its
ready file with a deadline, streams a text request through the gateway, writes
`<out>/result.json`, then stops the pipeline with SIGTERM and checks it exits cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

PROMPT = "Hello! In one sentence, what is an omni-modal model?"


def _wait_ready(proc: subprocess.Popen, ready_file: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready_file.exists() and ready_file.read_text().strip():
            return ready_file.read_text().strip()
        if proc.poll() is not None:
            raise SystemExit(f"demo: `omnistage serve` exited with {proc.returncode} before it was ready")
        time.sleep(0.2)
    raise SystemExit(f"demo: pipeline not ready after {timeout_s:.0f}s")


def _text_request(address: str) -> dict:
    request = omni_pb2.GenerateRequest(
        request_id="demo-text-1",
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=PROMPT)]),
        ],
        output_modalities=[omni_pb2.MODALITY_TEXT],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=48),
    )
    started = time.monotonic()
    text, token_ids, finish = [], [], None
    with grpc.insecure_channel(address) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        print(f"demo: prompt: {PROMPT}")
        print("demo: answer (tiny random weights, so the words are noise): ", end="", flush=True)
        for event in stub.Generate(request, timeout=120):
            kind = event.WhichOneof("event")
            if kind == "text":
                print(event.text.text, end="", flush=True)
                text.append(event.text.text)
                token_ids.extend(event.text.token_ids)
            elif kind == "finish":
                finish = event.finish
    print()
    if finish is None:
        raise SystemExit("demo: the stream ended without a Finish event")
    return {
        "modality": "text",
        "prompt": PROMPT,
        "text": "".join(text),
        "token_ids": token_ids,
        "finish_reason": common_pb2.FinishReason.Name(finish.reason),
        "prompt_tokens": finish.usage.prompt_tokens,
        "completion_tokens": finish.usage.completion_tokens,
        "time_to_first_token_ms": round(finish.usage.time_to_first_token_ms, 1),
        "wall_s": round(time.monotonic() - started, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="deploy/local-tiny.yaml")
    parser.add_argument("--out", default="demo-output")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="omnistage-demo-") as tmp:
        ready_file = Path(tmp) / "ready"
        cmd = [sys.executable, "-m", "omnistage.common.cli", "serve", args.config, "--ready-file", str(ready_file)]
        print("demo: starting:", " ".join(cmd[2:]), flush=True)
        proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            address = _wait_ready(proc, ready_file, args.ready_timeout_s)
            print(f"demo: pipeline ready, gateway at {address}", flush=True)
            results = [_text_request(address)]
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    (out / "result.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    for r in results:
        summary = {k: v for k, v in r.items() if k not in ("token_ids", "text")}
        print(f"demo: {r['modality']}: {json.dumps(summary, ensure_ascii=False)}")
    print(f"demo: saved {out / 'result.json'}; pipeline stopped (exit {proc.returncode})")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
