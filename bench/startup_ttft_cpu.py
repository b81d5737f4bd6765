"""Start-up time and TTFT of the CPU tiny pipeline, two checkouts side by side in one run (issue 42).

    python bench/startup_ttft_cpu.py --variant before=/tmp/base --variant after=. [--rounds 3] [--requests 8]

Each `--variant NAME=DIR` is a checkout with its own `.venv` (an editable install of that checkout).
Rounds alternate the variants (before, after, before, after, ...) so a busy host weighs on both alike.
Each round: `omnistage serve deploy/local-tiny.yaml` of that checkout, on free ports, with this
checkout's `.cache/tiny-ming`; start-up = spawn to the ready file; then `--requests` text requests one
after another through the gateway (16 tokens, ignore_eos), TTFT = the client's time to the first text
delta (`--requests 0`: none); then SIGTERM. Each round also records the host's load average at its
start, and each stage's CPU seconds (user + system, its live child processes included) and seconds
since spawn when the launcher saw it serving. Prints one JSON line per round and a Markdown table of
medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnistage.common.load_driver import RequestShape, one_request  # noqa: E402
from omnistage.v1 import omni_pb2_grpc  # noqa: E402

from load_tests.chaos_launch import free_ports  # noqa: E402

PORT_KEYS = ("port", "admin_port", "metrics_port", "dist_port")


def deploy_file(checkout: Path, out: Path) -> Path:
    """The checkout's local-tiny deploy file, on free ports, with this checkout's tiny checkpoint."""
    cfg = yaml.safe_load((checkout / "deploy" / "local-tiny.yaml").read_text())
    cfg["model"]["checkpoint"] = str(ROOT / ".cache" / "tiny-ming")
    for svc in cfg["services"].values():
        keys = [k for k in PORT_KEYS if svc.get(k)]
        for key, port in zip(keys, free_ports(len(keys)), strict=True):
            svc[key] = port
        if svc.get("gateway", {}).get("http_port"):
            svc["gateway"]["http_port"] = free_ports(1)[0]
    out.write_text(yaml.safe_dump(cfg))
    return out


async def ttfts(address: str, n: int) -> list[float]:
    shape = RequestShape(max_tokens=16, deadline_s=120.0, timeout_s=120.0)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        records = [await one_request(stub, "text", i, shape) for i in range(n)]
    bad = [r.detail or r.code for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"requests failed: {bad[:3]}")
    return [r.first_text_s * 1000 for r in records]


_STARTED = re.compile(r"^omnistage: started (\S+) r(\d+) \(pid (\d+)\)$", re.M)
_SERVING = re.compile(r"^(\S+) r(\d+) serving \(", re.M)
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (the thinker's grammar server)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name (it may hold spaces)
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICK
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += [c for c, parent in parents.items() if parent == p]
    return total


def watch_stages(log: Path, started: float, seen: dict[str, dict]) -> None:
    """Each stage rank newly serving in `log`: its CPU seconds and seconds since spawn, now."""
    text = log.read_text(errors="replace")
    pids = {f"{m[1]} r{m[2]}": int(m[3]) for m in _STARTED.finditer(text)}
    for m in _SERVING.finditer(text):
        key = f"{m[1]} r{m[2]}"
        if key not in seen and key in pids:
            seen[key] = {
                "serving_s": round(time.monotonic() - started, 1),
                "cpu_s": round(cpu_seconds(pids[key]), 1),
            }


def one_round(name: str, checkout: Path, requests: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"startup-{name}-") as tmp:
        cfg = deploy_file(checkout, Path(tmp) / "deploy.yaml")
        ready = Path(tmp) / "ready"
        log = (Path(tmp) / "serve.log").open("w")
        python = checkout / ".venv" / "bin" / "python"
        load = os.getloadavg()[0]
        stages: dict[str, dict] = {}
        started = time.monotonic()
        proc = subprocess.Popen(
            [str(python), "-m", "omnistage.common.cli", "serve", str(cfg), "--ready-file", str(ready)],
            cwd=checkout,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() - started > timeout_s:
                    raise RuntimeError(
                        f"{name}: serve did not start: {(Path(tmp) / 'serve.log').read_text()[-3000:]}"
                    )
                watch_stages(Path(tmp) / "serve.log", started, stages)
                time.sleep(0.1)
            startup_s = time.monotonic() - started
            watch_stages(Path(tmp) / "serve.log", started, stages)
            address = ready.read_text().strip()
            ms = asyncio.run(ttfts(address, requests)) if requests else []
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {
        "variant": name,
        "load_avg_1m": round(load, 1),
        "startup_s": round(startup_s, 2),
        "stages": dict(sorted(stages.items())),
        "cpu_s_total": round(sum(v["cpu_s"] for v in stages.values()), 1),
        "ttft_ms": [round(x, 1) for x in ms],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args()
    variants = [(v.split("=", 1)[0], Path(v.split("=", 1)[1]).resolve()) for v in args.variant]
    rows: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for _ in range(args.rounds):
        for name, checkout in variants:
            row = one_round(name, checkout, args.requests, args.timeout_s)
            rows[name].append(row)
            print(json.dumps(row), flush=True)
    print(
        "| variant | rounds | start-up s (median, each) | stage CPU s at serving (median, each) | TTFT ms |"
    )
    print("|---|---|---|---|---|")
    for name, got in rows.items():
        starts = [r["startup_s"] for r in got]
        cpu = [r["cpu_s_total"] for r in got]
        all_ttft = [t for r in got for t in r["ttft_ms"]]
        print(
            f"| {name} | {len(got)} | {statistics.median(starts):.1f} ({', '.join(f'{s:.1f}' for s in starts)})"
            f" | {statistics.median(cpu):.1f} ({', '.join(f'{c:.1f}' for c in cpu)})"
            f" | {statistics.median(all_ttft) if all_ttft else float('nan'):.0f} |"
        )


if __name__ == "__main__":
    main()
