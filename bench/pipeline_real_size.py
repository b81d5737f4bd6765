"""The whole pipeline at the real Ming sizes, measured through the gateway as a client sees it (issue 22).

    bench/pipeline_real_size.sh [CONFIG]                 # on the device machine (see that script)
    python bench/pipeline_real_size.py --config deploy/h200x4.yaml [--kinds text,vision,speech,image,mixed]
    python bench/pipeline_real_size.py --tiny            # CPU: deploy/local-tiny.yaml at the tiny sizes

Writes the config-only checkpoint of every part (`make-config-checkpoint --shape ming-flash`, or tiny),
runs `omnistage serve CONFIG --check` (its memory-ledger table goes into the results), starts `omnistage
serve` with `model.load_format: dummy` (random weights at the real sizes, made on the devices), then
runs closed loops of `c` clients through Omni.Generate (common/load_driver.py):

    text    c = 1 2 4 8 16 32, ~150 output tokens (ignore_eos)
    vision  an image (512²) + text in, text out, c = 1 4 16
    speech  text → speech (TTFA, RTF), c = 1 4 16
    image   text → image 1024², 30 steps, c = 1 2 4
    mixed   text, vision, speech, image in turn, c = 8 16

one unmeasured request of each kind first; then, when the deploy file has two or more image replicas,
image requests at c = 4 with the last replica SIGKILLed under them (its requests fail with
UNAVAILABLE naming it, the others go on; the row says how long until it was admitted again).
After every run the results are written again (a run cut
short still leaves the rows done): OUT/pipeline_real_size.json = {"device", "date", "command", "rows":
[{kind, concurrency, req_s, tok_s, e2e_p50_ms, e2e_p95_ms, ttft_p50_ms, ttfa_p50_ms, rtf_mean, errors,
...}], "memory": the ledger and the peak memory nvidia-smi saw per GPU, "status": `omnistage status`
(each service's Describe memory report)}, OUT/pipeline_real_size.md (the table in bench/RESULTS.md's
format) and OUT/pipeline_real_size.serve.log. Runs that would start after --budget-s seconds of load
are skipped and listed (a device call has a time limit). Random weights: the words are noise, the
shapes, the memory and the time are the release's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "load_tests"))

from omnistage.common.bench_results import write_result  # noqa: E402
from omnistage.common.checkpoint.config_only import write_config_checkpoint  # noqa: E402
from omnistage.common.config import DeployConfig, load_config  # noqa: E402
from omnistage.common.load_driver import KINDS, MIXED, RequestShape, closed_loop, one_request  # noqa: E402
from omnistage.common.load_stats import Record, Summary, summarize  # noqa: E402
from omnistage.v1 import omni_pb2_grpc  # noqa: E402
from pipeline_load import pipeline  # noqa: E402

GIB = 1 << 30


@dataclass(frozen=True)
class Part:
    """One kind's runs: its concurrency levels and request shape."""

    kind: str
    levels: tuple[int, ...]
    shape: RequestShape
    min_requests: int = 4

    def requests(self, c: int) -> int:
        return max(self.min_requests, 2 * c)


def real_plan(timeout_s: float) -> list[Part]:
    base = RequestShape(
        max_tokens=150,
        deadline_s=timeout_s,
        timeout_s=timeout_s,
        image_size=1024,
        image_steps=30,
        input_image_px=512,
    )
    return [
        Part("text", (1, 2, 4, 8, 16, 32, 64), base),  # 64: issue 40's highest level
        Part("vision", (1, 4, 16), base),
        Part("speech", (1, 4, 16), replace(base, max_tokens=64)),
        Part("image", (1, 2, 4), base, min_requests=3),
        Part("mixed", (8, 16), replace(base, max_tokens=64)),
    ]


def tiny_plan(timeout_s: float) -> list[Part]:
    base = RequestShape(
        max_tokens=16,
        deadline_s=timeout_s,
        timeout_s=timeout_s,
        image_size=256,
        image_steps=4,
        input_image_px=128,
    )
    return [
        Part("text", (1, 2), base, min_requests=2),
        Part("vision", (1,), base, min_requests=2),
        Part("speech", (1,), replace(base, max_tokens=8), min_requests=2),
        Part("image", (1,), base, min_requests=2),
        Part("mixed", (4,), replace(base, max_tokens=8), min_requests=4),
    ]


def row(part: Part, c: int, summary: Summary, records: list[Record]) -> dict:
    """One results row (issue 22's keys), with the run's size and errors by status besides."""
    rtfs = [x for r in records if r.ok and (x := r.rtf) is not None]
    return {
        "kind": part.kind,
        "concurrency": c,
        "req_s": summary.req_per_s,
        "tok_s": summary.tok_per_s,
        "e2e_p50_ms": summary.e2e_ms.get("p50"),
        "e2e_p95_ms": summary.e2e_ms.get("p95"),
        "ttft_p50_ms": summary.ttft_ms.get("p50"),
        "ttfa_p50_ms": summary.ttfa_ms.get("p50"),
        "rtf_mean": round(statistics.fmean(rtfs), 3) if rtfs else None,
        "errors": sum(summary.errors.values()),
        "requests": summary.requests,
        "wall_s": summary.wall_s,
        "max_tokens": part.shape.max_tokens,
        "errors_by_status": summary.errors,
        "error_details": summary.error_details,
    }


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f} ms"


def table(rows: list[dict]) -> str:
    """bench/RESULTS.md's columns plus TTFT / TTFA / RTF."""
    lines = [
        "| Mode | Concurrency | Reqs | Wall | E2E p50 | E2E p95 | req/s | tok/s | TTFT p50 | TTFA p50 | RTF mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        errs = f" ({r['errors']} errors)" if r["errors"] else ""
        rtf = "—" if r["rtf_mean"] is None else f"{r['rtf_mean']:.2f}"
        lines.append(
            f"| {r['kind']} | {r['concurrency']} | {r['requests']}{errs} | {r['wall_s']:.1f} s | "
            f"{_ms(r['e2e_p50_ms'])} | {_ms(r['e2e_p95_ms'])} | {r['req_s']:.2f} | {r['tok_s']:.1f} | "
            f"{_ms(r['ttft_p50_ms'])} | {_ms(r['ttfa_p50_ms'])} | {rtf} |"
        )
    details = [
        f"- {r['kind']} c={r['concurrency']} {code}: {text}"
        for r in rows
        for code, text in (r.get("error_details") or {}).items()
    ]
    return "\n".join(lines + (["", "First error of each kind:", *details] if details else []))


def device_name() -> str:
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        names = []
    names = [n.strip() for n in names if n.strip()]
    return (
        f"{len(names)} x {names[0]}"
        if names
        else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )


class GpuMemory:
    """The largest memory.used nvidia-smi reports per GPU while running (every 2 s); {} without GPUs."""

    def __init__(self) -> None:
        self.peak_mib: dict[str, int] = {}
        self.total_mib: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return
        for line in out.splitlines():
            index, used, total = (x.strip() for x in line.split(","))
            self.peak_mib[f"cuda:{index}"] = max(self.peak_mib.get(f"cuda:{index}", 0), int(used))
            self.total_mib[f"cuda:{index}"] = int(total)

    def _run(self) -> None:
        while not self._stop.wait(2.0):
            self.sample()

    @contextlib.contextmanager
    def watching(self) -> Iterator[GpuMemory]:
        self.sample()
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=35)


def cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omnistage.common.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


class Results:
    """The JSON and the markdown table, rewritten after every run. `gpu`: a GPU run of the real sizes
    (only such a run may replace a file that holds one: common/bench_results.py)."""

    def __init__(self, out: Path, meta: dict, gpu: bool) -> None:
        self.out = out
        self.gpu = gpu
        self.data = {**meta, "rows": [], "skipped": []}

    def save(self) -> None:
        write_result(self.out / "pipeline_real_size.json", self.data, gpu=self.gpu)
        (self.out / "pipeline_real_size.md").write_text(table(self.data["rows"]) + "\n")


@dataclass(frozen=True)
class ReplicaKill:
    """The replica to SIGKILL under image load, and where to see it: the serve log and the gateway's /metrics."""

    replica: str
    serve_log: Path
    gateway_metrics: str
    part: Part

    def pid(self) -> int:
        pids = re.findall(rf"omnistage: started {self.replica} r0 \(pid (\d+)\)", self.serve_log.read_text())
        if not pids:
            raise RuntimeError(f"no {self.replica} process in {self.serve_log}")
        return int(pids[-1])

    def in_flight(self) -> float:
        prefix = f'omnistage_gateway_stage_calls_in_flight{{replica="{self.replica}"'
        try:
            text = urllib.request.urlopen(self.gateway_metrics, timeout=5).read().decode()
        except OSError:
            return 0.0
        return next(
            (float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)), 0.0
        )

    def readmitted(self) -> int:
        return self.serve_log.read_text().count(f"stage {self.replica} SERVING again: re-admitted")


async def kill_under_load(stub: omni_pb2_grpc.OmniStub, kill: ReplicaKill, c: int) -> dict:
    """Image requests at concurrency `c` with `kill.replica` SIGKILLed once it denoises some of them: a
    row whose errors are its requests (each status names it), plus how long until it was admitted again."""
    part = kill.part
    readmitted = kill.readmitted()
    t0 = time.perf_counter()
    run = asyncio.create_task(closed_loop(stub, "image", part.requests(c), c, part.shape))
    while not kill.in_flight() and not run.done() and time.perf_counter() - t0 < 120:
        await asyncio.sleep(0.2)
    os.kill(kill.pid(), signal.SIGKILL)
    killed_at = time.perf_counter()
    records = await run
    summary = summarize("closed", "image", str(c), records, time.perf_counter() - t0)
    out = {
        **row(replace(part, kind="image_replica_killed"), c, summary, records),
        "killed": kill.replica,
        "killed_after_s": round(killed_at - t0, 1),
    }
    while kill.readmitted() == readmitted and time.perf_counter() - killed_at < 300:
        await asyncio.sleep(1.0)
    out["readmitted_after_s"] = (
        round(time.perf_counter() - killed_at, 1) if kill.readmitted() > readmitted else None
    )
    return out


async def run_parts(
    address: str, parts: list[Part], results: Results, budget_s: float, kill: ReplicaKill | None = None
) -> None:
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        firsts = {k: p.shape for p in parts for k in (MIXED if p.kind == "mixed" else (p.kind,))}
        for (
            kind,
            shape,
        ) in firsts.items():  # one unmeasured request of every kind (connections, first-call costs)
            rec = await one_request(stub, kind, 0, shape)
            print(f"first {kind} request: {rec.code} in {rec.e2e_s:.1f} s", flush=True)
        started = time.monotonic()
        for part in parts:
            for c in part.levels:
                if time.monotonic() - started > budget_s:
                    results.data["skipped"].append(
                        {"kind": part.kind, "concurrency": c, "why": f"past --budget-s {budget_s:g}"}
                    )
                    results.save()
                    continue
                t0 = time.perf_counter()
                records = await closed_loop(stub, part.kind, part.requests(c), c, part.shape)
                summary = summarize("closed", part.kind, str(c), records, time.perf_counter() - t0)
                results.data["rows"].append(row(part, c, summary, records))
                results.save()
                print(table(results.data["rows"][-1:]).splitlines()[-1], flush=True)
        if kill is not None:
            if time.monotonic() - started > budget_s:
                results.data["skipped"].append(
                    {"kind": "image_replica_killed", "why": f"past --budget-s {budget_s:g}"}
                )
            else:
                results.data["rows"].append(await kill_under_load(stub, kill, 4))
                print(table(results.data["rows"][-1:]).splitlines()[-1], flush=True)
            results.save()


def gateway_metrics_url(cfg: DeployConfig) -> str:
    """The gateway's /metrics ('' without a metrics port)."""
    gateway = cfg.services_of("gateway")
    return (
        f"http://{cfg.host}:{gateway[0].metrics_port}/metrics" if gateway and gateway[0].metrics_port else ""
    )


def wait_all_replicas(url: str, timeout_s: float) -> str:
    """Wait until the gateway has admitted every stage replica (its omnistage_gateway_stage_up all 1;
    `serve` is ready once each capability has one); '' when they are, else the ones still out."""
    deadline = time.monotonic() + timeout_s
    out: list[str] = []
    while url:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError as exc:
            return f"gateway metrics unreadable: {exc}"
        out = [
            line.split("{")[1].split("}")[0]
            for line in text.splitlines()
            if line.startswith("omnistage_gateway_stage_up{") and float(line.rsplit(" ", 1)[1]) == 0
        ]
        if not out or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return "; ".join(out)


def replica_kill(
    args: argparse.Namespace, cfg: DeployConfig, serve_log: Path, plan: list[Part]
) -> ReplicaKill | None:
    """The last image-generation replica, when the deploy file has two or more and --kill-replica is on."""
    replicas, url = cfg.services_of("imagegen"), gateway_metrics_url(cfg)
    if not args.kill_replica or len(replicas) < 2 or not url:
        return None
    return ReplicaKill(replicas[-1].name, serve_log, url, next(p for p in plan if p.kind == "image"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config",
        default="",
        help="deploy file (default deploy/h200x4.yaml; --tiny: deploy/local-tiny.yaml)",
    )
    ap.add_argument("--tiny", action="store_true", help="the tiny sizes and a small plan (CPU)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ", ".join(KINDS))
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for `omnistage serve` (repeatable)",
    )
    ap.add_argument(
        "--checkpoint", default="", help="config-only checkpoint folder (default: written to a temp dir)"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="skip runs that would start later than this many seconds into the load (0: no limit)",
    )
    ap.add_argument("--timeout-s", type=float, default=300.0, help="gRPC deadline of each request")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument(
        "--command", default="", help="the command line to record (the shell wrapper passes its own)"
    )
    ap.add_argument(
        "--http-front",
        action="store_true",
        help="keep the gateway's HTTP front (off by default: the load speaks gRPC)",
    )
    ap.add_argument(
        "--no-kill-replica",
        dest="kill_replica",
        action="store_false",
        help="skip the last run: with two or more image replicas, one is SIGKILLed under image load",
    )
    args = ap.parse_args(argv)
    args.config = args.config or str(ROOT / "deploy" / ("local-tiny.yaml" if args.tiny else "h200x4.yaml"))
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: a comma-separated subset of {', '.join(KINDS)}")
    args.kinds = kinds
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    plan = (tiny_plan if args.tiny else real_plan)(args.timeout_s)
    parts = [p for p in plan if p.kind in args.kinds]
    with tempfile.TemporaryDirectory(prefix="ming-config-") as tmp:
        ckpt = Path(args.checkpoint or Path(tmp) / "ckpt")
        if not (ckpt / "config.json").is_file():
            write_config_checkpoint(ckpt, "tiny" if args.tiny else "ming-flash")
        overrides = [f"model.checkpoint={ckpt}", "model.load_format=dummy", *args.overrides]
        if not args.http_front:  # the load is gRPC; the device image may lack the HTTP front's packages
            overrides += [
                f"services.{g.name}.gateway.http_port=0"
                for g in load_config(args.config, overrides).services_of("gateway")
            ]
        check = cli("serve", args.config, "--check", *(f"--set={o}" for o in overrides))
        print(check.stdout + check.stderr, flush=True)
        if check.returncode != 0:
            return check.returncode
        device = device_name()
        results = Results(
            out,
            {
                "device": device,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "command": args.command or " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                "config": os.path.relpath(args.config, ROOT),
                "shape": "tiny" if args.tiny else "ming-flash",
                "load_format": "dummy",
                "memory": {"ledger": check.stdout.strip()},
            },
            gpu=not device.startswith("cpu") and not args.tiny,
        )
        results.save()  # before the load: a run that may not write its file stops here
        memory = GpuMemory()
        started = time.monotonic()
        serve_log = out / "pipeline_real_size.serve.log"
        cfg = load_config(args.config, overrides)
        kill = replica_kill(args, cfg, serve_log, plan)
        with memory.watching(), pipeline(args.config, overrides, serve_log) as address:
            results.data["startup_s"] = round(time.monotonic() - started, 1)
            print(f"pipeline ready in {results.data['startup_s']} s at {address}", flush=True)
            missing = wait_all_replicas(gateway_metrics_url(cfg), 300.0)
            results.data["replicas_admitted_s"] = round(time.monotonic() - started, 1)
            if missing:
                results.data["replicas_not_admitted"] = missing
                print(f"not every replica admitted: {missing}", flush=True)
            try:
                asyncio.run(run_parts(address, parts, results, args.budget_s or float("inf"), kill))
            finally:
                status = cli(
                    "status", "--config", args.config, *(f"--set={o}" for o in overrides), timeout_s=60
                )
                results.data["status"] = status.stdout.strip()
                memory.sample()
                results.data["memory"] |= {"peak_used_mib": memory.peak_mib, "total_mib": memory.total_mib}
                results.save()
    print("\n" + table(results.data["rows"]))
    if results.data["skipped"]:
        print(f"skipped (budget): {results.data['skipped']}")
    print(f"results: {out / 'pipeline_real_size.json'}")
    # The killed replica's requests are meant to fail; any other error fails the run.
    return 1 if any(r["errors"] for r in results.data["rows"] if r["kind"] != "image_replica_killed") else 0


if __name__ == "__main__":
    sys.exit(main())
