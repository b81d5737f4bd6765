"""Load test of a whole pipeline through the public gateway API (`omnistage.v1.Omni.Generate`).

python load_tests/pipeline_load.py [--config deploy/local-tiny.yaml | --address HOST:PORT]
    [--kinds text,speech,image] [--modes closed,offline,poisson] [--concurrency 1,2,4,8]
    [--requests 16] [--rates 0.5,1] [--max-tokens 16] [--deadline-s 30] [--out bench/load]
python load_tests/pipeline_load.py --replot A/results.json [B/results.json ...] --out DIR

Without --address it starts `omnistage serve CONFIG` and stops it at the end. Modes:
- closed: `c` clients, each sends its next request when the previous one finished (per concurrency);
- offline: every request sent at once (a batch job: throughput, not latency);
- poisson: open loop, arrivals with exponential gaps at each rate (req/s), whatever the replies do.
Kinds: text (MODALITY_TEXT), speech (MODALITY_AUDIO: text + the talker's audio), image
(MODALITY_IMAGE: needs an imagegen stage). Per run: req/s, tok/s, goodput (OK within --deadline-s,
per second), E2E p50/p95/p99, TTFT, TPOT, TTFA, RTF, errors by gRPC status. Writes
`OUT/results.json`, `OUT/table.md` and, with matplotlib (`pip install -e .[bench]`), `OUT/load.png`.
The requests and their statistics are omnistage.common.load_driver / load_stats, which `omnistage
bench` runs too (against a running gateway, with its API key and TLS, no plot).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from omnistage.common.load_driver import KINDS, MODES, RequestShape, plan, run_plan
from omnistage.common.load_stats import Summary, details_table, markdown_table
from omnistage.v1 import omni_pb2_grpc

_START_DEADLINE_S = 900.0
_STOP_DEADLINE_S = 60.0


def shape_of(args: argparse.Namespace) -> RequestShape:
    return RequestShape(
        max_tokens=args.max_tokens,
        deadline_s=args.deadline_s,
        timeout_s=args.timeout_s,
        image_size=args.image_size,
        image_steps=args.image_steps,
    )


async def run_all(address: str, args: argparse.Namespace) -> list[Summary]:
    options = [("grpc.max_receive_message_length", 64 << 20)]
    runs = list(plan(args.kinds, args.modes, args.concurrency, args.rates))
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        return await run_plan(
            omni_pb2_grpc.OmniStub(channel),
            runs,
            args.requests,
            shape_of(args),
            seed=args.seed,
            on_summary=lambda s: print(markdown_table([s]).splitlines()[-1], flush=True),
        )


@contextlib.contextmanager
def pipeline(config: str, overrides: list[str], log: Path) -> Iterator[str]:
    """`omnistage serve CONFIG --set ...` until the block ends (its output in `log`: restarts show
    there); yields the gateway address."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "omnistage.common.cli",
                    "serve",
                    config,
                    "--ready-file",
                    str(ready),
                    *(f"--set={o}" for o in overrides),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
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
        runs = [
            s for s in summaries if s.kind == kind and s.mode == "closed" and s.e2e_ms.get("p50") is not None
        ]
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
    ap.add_argument(
        "--config", default="deploy/local-tiny.yaml", help="deploy file to start (without --address)"
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override passed to `omnistage serve` (repeatable)",
    )
    ap.add_argument("--address", default="", help="gateway of a running pipeline (nothing is started)")
    ap.add_argument("--kinds", default="text", type=lambda s: [k for k in s.split(",") if k])
    ap.add_argument("--modes", default="closed", type=lambda s: [m for m in s.split(",") if m])
    ap.add_argument("--concurrency", default="1,2,4,8", type=lambda s: [int(x) for x in _floats(s)])
    ap.add_argument("--rates", default="1", type=_floats, help="Poisson arrival rates, req/s")
    ap.add_argument(
        "--requests", type=int, default=16, help="requests per run (closed: at least the concurrency)"
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    ap.add_argument("--deadline-s", type=float, default=30.0, help="goodput deadline per request")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="gRPC deadline per request")
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--image-steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/load", help="directory of results.json, table.md, load.png")
    ap.add_argument(
        "--replot",
        nargs="+",
        default=[],
        metavar="RESULTS_JSON",
        help="run nothing: write table.md and load.png in --out from these results.json files",
    )
    args = ap.parse_args(argv)
    bad = [k for k in args.kinds if k not in KINDS] + [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"unknown kind or mode {bad[0]!r}")
    return args


def replot(results: list[Path], out: Path) -> None:
    """Tables and the plot again from earlier runs' results.json (e.g. a GPU machine without
    matplotlib): every run of every file, in order."""
    summaries = [Summary(**run) for path in results for run in json.loads(path.read_text())["runs"]]
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(summaries) + "\n\n" + details_table(summaries) + "\n"
    (out / "table.md").write_text(table)
    print(table)
    why = plot(summaries, out / "load.png")
    print(why or f"plot: {out / 'load.png'}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        replot([Path(p) for p in args.replot], Path(args.out))
        return
    out = Path(args.out)
    log = out / "serve.log"
    with contextlib.ExitStack() as stack:
        address = args.address or stack.enter_context(pipeline(args.config, args.overrides, log))
        summaries = asyncio.run(run_all(address, args))
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": vars(args),
        "runs": [s.to_json() for s in summaries],
    }
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
