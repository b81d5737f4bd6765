"""Load test of a whole pipeline through the public gateway API (`omnistage.v1.Omni.Generate`).

python load_tests/pipeline_load.py [--config deploy/local-tiny.yaml | --address HOST:PORT]
    [--kinds text,speech,image] [--modes closed,offline,poisson] [--concurrency 1,2,4,8]
    [--requests 16] [--rates 0.5,1] [--max-tokens 16] [--deadline-s 30] [--out bench/load]

Without --address it starts `omnistage serve CONFIG` and stops it at the end. Modes:
- closed: `c` clients, each sends its next request when the previous one finished (per concurrency);
- offline: every request sent at once (a batch job: throughput, not latency);
- poisson: open loop, arrivals with exponential gaps at each rate (req/s), whatever the replies do.
Kinds: text (MODALITY_TEXT), speech (MODALITY_AUDIO: text + the talker's audio), image
(MODALITY_IMAGE: needs an imagegen stage). Per run: req/s, tok/s, goodput (OK within --deadline-s,
per second), E2E p50/p95/p99, TTFT, TPOT, TTFA, RTF, errors by gRPC status. Writes
`OUT/results.json`, `OUT/table.md` and, with matplotlib (`pip install -e .[bench]`), `OUT/load.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
from load_stats import Record, Summary, details_table, markdown_table, summarize  # noqa: E402

PROMPTS = {
    "text": "Tell me a short story about the moon.",
    "speech": "Say hello and describe the weather today.",
    "image": "A red bicycle leaning on a blue wall.",
}
MODALITY = {"text": omni_pb2.MODALITY_TEXT, "speech": omni_pb2.MODALITY_AUDIO, "image": omni_pb2.MODALITY_IMAGE}
_START_DEADLINE_S = 900.0
_STOP_DEADLINE_S = 60.0


def make_request(kind: str, i: int, args: argparse.Namespace) -> omni_pb2.GenerateRequest:
    parts = [omni_pb2.ContentPart(text=PROMPTS[kind])]
    req = omni_pb2.GenerateRequest(
        request_id=f"load-{kind}-{i}",
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=parts)],
        output_modalities=[MODALITY[kind]],
        sampling=common_pb2.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i),
    )
    if kind == "image":
        req.image.CopyFrom(omni_pb2.ImageOptions(width=args.image_size, height=args.image_size,
                                                 steps=args.image_steps, seed=i))
    return req


async def one_request(stub: omni_pb2_grpc.OmniStub, kind: str, i: int, args: argparse.Namespace) -> Record:
    """Send one request and time its events on the client."""
    rec = Record(kind, time.perf_counter(), 0.0, args.deadline_s)
    finish = None
    try:
        async for ev in stub.Generate(make_request(kind, i, args), timeout=args.timeout_s):
            now = time.perf_counter() - rec.start
            which = ev.WhichOneof("event")
            if which == "text":
                rec.first_text_s = now if rec.first_text_s is None else rec.first_text_s
                rec.last_text_s = now
            elif which == "audio" and ev.audio.pcm16:
                if rec.first_audio_s is None:
                    rec.first_audio_s = now
                rec.audio_seconds += len(ev.audio.pcm16) / 2 / max(ev.audio.sample_rate_hz, 1)
            elif which == "finish":
                finish = ev.finish
        rec.code = _finish_code(kind, finish)
        if finish is not None:
            rec.completion_tokens = finish.usage.completion_tokens
    except grpc.aio.AioRpcError as exc:
        rec.code = exc.code().name
    rec.end = time.perf_counter()
    return rec


def _finish_code(kind: str, finish: omni_pb2.Finish | None) -> str:
    if finish is None:
        return "NO_FINISH"
    if finish.reason in (common_pb2.FINISH_REASON_ERROR, common_pb2.FINISH_REASON_ABORT):
        return common_pb2.FinishReason.Name(finish.reason).replace("_REASON", "")
    if kind == "speech" and finish.audio.outcome != omni_pb2.AUDIO_OUTCOME_COMPLETE:
        return f"AUDIO_{finish.audio.code or omni_pb2.AudioOutcome.Name(finish.audio.outcome).split('_')[-1]}"
    return "OK"


async def closed_loop(stub: omni_pb2_grpc.OmniStub, kind: str, n: int, c: int,
                      args: argparse.Namespace) -> list[Record]:
    """`c` clients sharing `n` requests, each sending its next one when the last one ended."""
    ids = iter(range(n))
    records: list[Record] = []

    async def client() -> None:
        for i in ids:
            records.append(await one_request(stub, kind, i, args))

    await asyncio.gather(*(client() for _ in range(min(c, n))))
    return records


async def poisson(stub: omni_pb2_grpc.OmniStub, kind: str, n: int, rate: float, seed: int,
                  args: argparse.Namespace) -> list[Record]:
    """Open loop: `n` arrivals with exponential gaps at `rate`/s, never waiting for replies."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one_request(stub, kind, i, args)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def plan(args: argparse.Namespace) -> Iterator[tuple[str, str, str]]:
    """(mode, kind, load) of every run, in the order they run."""
    for kind in args.kinds:
        for mode in args.modes:
            if mode == "closed":
                yield from ((mode, kind, str(c)) for c in args.concurrency)
            elif mode == "offline":
                yield mode, kind, "all"
            else:
                yield from ((mode, kind, f"{r:g}/s") for r in args.rates)


async def run_all(address: str, args: argparse.Namespace) -> list[Summary]:
    options = [("grpc.max_receive_message_length", 64 << 20)]
    summaries = []
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        for kind in args.kinds:  # one unmeasured request per kind: connections and first-call costs
            await one_request(stub, kind, 0, args)
        for mode, kind, load in plan(args):
            started = time.perf_counter()
            if mode == "closed":
                records = await closed_loop(stub, kind, args.requests, int(load), args)
            elif mode == "offline":
                records = await closed_loop(stub, kind, args.requests, args.requests, args)
            else:
                records = await poisson(stub, kind, args.requests, float(load.removesuffix("/s")), args.seed, args)
            s = summarize(mode, kind, load, records, time.perf_counter() - started)
            print(markdown_table([s]).splitlines()[-1], flush=True)
            summaries.append(s)
    return summaries


@contextlib.contextmanager
def pipeline(config: str, overrides: list[str], log: Path) -> Iterator[str]:
    """`omnistage serve CONFIG --set ...` until the block ends (its output in `log`: restarts show
    there); yields the gateway address."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "omnistage.common.cli", "serve", config,
                                     "--ready-file", str(ready), *(f"--set={o}" for o in overrides)], stdout=out, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            deadline = time.monotonic() + _START_DEADLINE_S
            while not (ready.exists() and ready.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the pipeline did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
            yield ready.read_text().strip()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def plot(summaries: list[Summary], path: Path) -> str:
    """E2E p50 and goodput against concurrency of the closed-loop runs, per kind; '' or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e .[bench]): no plot"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ticks: set[int] = set()
    for kind in sorted({s.kind for s in summaries}):
        runs = [s for s in summaries if s.kind == kind and s.mode == "closed" and s.e2e_ms.get("p50") is not None]
        if not runs:
            continue
        cs = [int(s.load) for s in runs]
        ticks.update(cs)
        ax1.plot(cs, [s.e2e_ms["p50"] for s in runs], marker="o", label=f"{kind} p50")
        ax1.plot(cs, [s.e2e_ms["p95"] for s in runs], marker="x", linestyle="--", label=f"{kind} p95")
        ax2.plot(cs, [s.goodput_per_s for s in runs], marker="o", label=kind)
    ax1.set(xlabel="concurrency", ylabel="E2E latency (ms)", title="latency (closed loop)")
    ax2.set(xlabel="concurrency", ylabel="requests OK within deadline / s", title="goodput (closed loop)")
    for ax in (ax1, ax2):
        ax.set_xticks(sorted(ticks))
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return ""


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deploy/local-tiny.yaml", help="deploy file to start (without --address)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override passed to `omnistage serve` (repeatable)")
    ap.add_argument("--address", default="", help="gateway of a running pipeline (nothing is started)")
    ap.add_argument("--kinds", default="text", type=lambda s: [k for k in s.split(",") if k])
    ap.add_argument("--modes", default="closed", type=lambda s: [m for m in s.split(",") if m])
    ap.add_argument("--concurrency", default="1,2,4,8", type=lambda s: [int(x) for x in _floats(s)])
    ap.add_argument("--rates", default="1", type=_floats, help="Poisson arrival rates, req/s")
    ap.add_argument("--requests", type=int, default=16, help="requests per run")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    ap.add_argument("--deadline-s", type=float, default=30.0, help="goodput deadline per request")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="gRPC deadline per request")
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--image-steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/load", help="directory of results.json, table.md, load.png")
    args = ap.parse_args(argv)
    bad = [k for k in args.kinds if k not in MODALITY] + [m for m in args.modes if m not in
                                                          ("closed", "offline", "poisson")]
    if bad:
        ap.error(f"unknown kind or mode {bad[0]!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    log = out / "serve.log"
    with contextlib.ExitStack() as stack:
        address = args.address or stack.enter_context(pipeline(args.config, args.overrides, log))
        summaries = asyncio.run(run_all(address, args))
    out.mkdir(parents=True, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args),
               "runs": [s.to_json() for s in summaries]}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown_table(summaries) + "\n\n" + details_table(summaries) + "\n"
    (out / "table.md").write_text(table)
    print("\n" + table)
    if not args.address:  # a restart in the middle of a run explains its errors
        for line in log.read_text().splitlines():
            if "restarting" in line:
                print(f"warning: the pipeline restarted a service during the run: {line}")
    why = plot(summaries, out / "load.png")
    print(why or f"plot: {out / 'load.png'}")


if __name__ == "__main__":
    main()
