"""Time to first token through `omnistage serve`, attention backends side by side (issue 39).

    bench/prefill_ttft.sh [CONFIG]                  # on the device machine: ONE command (see that script)
    python bench/prefill_ttft.py --config deploy/h200x2.yaml --backends triton,flashinfer
    python bench/prefill_ttft.py --tiny --out DIR   # CPU dry run: deploy/local-tiny.yaml, tiny sizes
    python bench/prefill_ttft.py ... --profile      # only the short case and its breakdown
    python bench/prefill_ttft.py --tiny --cases text_c* --bursts 1,8,32 --burst-rounds 3  # arrivals together
    python bench/prefill_ttft.py --config RUNNING.yaml --attach [--key K] [--serve-log LOG]
                                                    # against a serve already running that file

For each attention backend (`--backends`, each its own `serve` with
`services.<thinker>.engine.attention_backend=NAME`, config-only checkpoint, `load_format: dummy`) it
runs, from this process as an outside client (gRPC Omni.Generate; the OpenAI HTTP front for
short_http), the cases of bench/prefill_cases.py:

    short, short_http        a ~60-token chat prompt, c = 1, a new prefix each time
    prompt_1k, prompt_5k     1,050 / 5,030 prompt tokens, a new prefix each time, c = 1
    prompt_*_cached          one such prompt sent again and again (its prefix cached)
    text_c8, text_c32        8 / 32 short prompts sent at once (256 new tokens each), twice
    image_1024, audio_3s     a 1024² PNG / a 3 s WAV + a question, c = 1 (encoder → thinker)
    itl_5k                   16 streams decoding while 5k-token prompts arrive: their inter-token p50/p95

and each case's breakdown (means over its timed requests, from the deltas of the gateway's and the
thinker's histograms: client ↔ gateway, gateway admission, gateway → engine (parse, template,
transport, the thinker's tokenize and submit), engine queue, the prefill steps' phases — schedule,
plan, launch, sample, wait (the device's work ends there), output — and what is left); `--profile` runs the
short case alone, for the breakdown of one short request; `--cases` takes names or patterns. With
`--attach` no serve starts: the cases run against the pipeline already serving `--config` (a test's
tiny pipeline, a deployment), its backend read from `--serve-log` (that serve's output) when given.

Results, rewritten after every case: OUT/prefill_ttft.json = {"device", "date", "command", "rows":
[{case, concurrency, prompt_tokens, cached_tokens, ttft_p50_ms, ttft_p95_ms, prompt_tok_s, backend,
breakdown, ...}], "backends", "checks"} and OUT/prefill_ttft.md. Without a GPU (or with --tiny) the
file is prefill_ttft.dry.json instead: a dry run never writes the GPU result file. Random weights: the
words are noise, the shapes and the time are the release's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import fnmatch
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "load_tests"))
sys.path.insert(0, str(ROOT / "bench"))

from chaos_launch import free_ports  # noqa: E402
from omnistage.common.bench_results import write_result  # noqa: E402
from omnistage.common.checkpoint.config_only import write_config_checkpoint  # noqa: E402
from omnistage.common.config import DeployConfig, load_config  # noqa: E402
from omnistage.common.runtime.auth import key_interceptors  # noqa: E402
from omnistage.v1 import omni_pb2_grpc  # noqa: E402
from pipeline_load import pipeline  # noqa: E402
from pipeline_real_size import device_name, gateway_metrics_url, wait_all_replicas  # noqa: E402
from prefill_cases import TINY, Client, Plan, Prompts, cases  # noqa: E402

PHASES = ("schedule", "plan", "launch", "sample", "wait", "output")
STARTUP_PHASES = ("starting", "loading_weights", "profiling_memory", "warming_up", "capturing_graphs")


# --- metrics: the profile ---------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, `name{labels}` → value ({} when unreadable)."""
    if not url:
        return {}
    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def hist_mean(before: dict[str, float], after: dict[str, float], name: str, *labels: str) -> float | None:
    """Mean (ms) of histogram `name` over what was observed between two scrapes (the series holding
    every one of `labels`, e.g. 'step="prefill"')."""

    def total(page: dict[str, float], suffix: str) -> float:
        return sum(v for k, v in page.items() if k.startswith(name + suffix) and all(x in k for x in labels))

    count = total(after, "_count") - total(before, "_count")
    if count <= 0:
        return None
    return round((total(after, "_sum") - total(before, "_sum")) / count * 1000.0, 2)


def breakdown(before: dict, after: dict, client_ms: float | None, engine_ms: float | None) -> dict:
    """Where a short request's time to first token went (ms, means). Gateway and thinker pages merged."""
    gateway = hist_mean(before, after, "omnistage_gateway_ttft_seconds")
    admission = hist_mean(before, after, "omnistage_gateway_admission_wait_seconds") or 0.0
    engine = hist_mean(before, after, "omnistage_thinker_ttft_seconds") or engine_ms
    queue = hist_mean(before, after, "omnistage_thinker_queue_time_seconds")
    phases = {
        p: hist_mean(before, after, "omnistage_thinker_step_phase_seconds", f'phase="{p}"', 'step="prefill"')
        for p in PHASES
    }
    out: dict = {"client_ttft_ms": client_ms, "gateway_ttft_ms": gateway, "engine_ttft_ms": engine}
    if client_ms is not None and gateway is not None:
        out["client_to_gateway_ms"] = round(client_ms - gateway, 2)
    out["gateway_admission_wait_ms"] = admission
    if gateway is not None and engine is not None:
        out["gateway_to_engine_ms"] = round(gateway - admission - engine, 2)
    out["engine_queue_ms"] = queue
    out |= {f"prefill_step_{p}_ms": v for p, v in phases.items()}
    known = [v for v in (queue, *phases.values()) if v is not None]
    if engine is not None and known:
        out["engine_other_ms"] = round(engine - sum(known), 2)
    return out


# --- one backend ----------------------------------------------------------------------------------


def resolved_backend(log: Path, asked: str) -> str:
    """The attention kernels the thinker says it runs, and a FlashInfer fallback if one happened."""
    text = log.read_text(errors="replace") if log.exists() else ""
    chosen = re.findall(r"kernels: attention (\w+)", text)
    name = chosen[-1] if chosen else asked
    if "FlashInfer prefill off" in text:
        name += " (fell back to triton)"
    return name


async def run_backend(address: str, cfg: DeployConfig, plan: Plan, wanted: list[str], ctx: dict) -> None:
    """Every case against one serve, each with its breakdown (histogram deltas over its timed part);
    rows saved as they come."""
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    gateway = cfg.services_of("gateway")[0]
    http = (cfg.host, gateway.gateway.http_port) if gateway.gateway.http_port else None
    thinker = cfg.services_of("thinker")[0]
    pages = [gateway_metrics_url(cfg), f"http://{cfg.host}:{thinker.metrics_port}/metrics"]
    before: dict[str, float] = {}

    async def timed() -> None:
        before.clear()
        before.update(
            await asyncio.to_thread(lambda: {k: v for url in pages for k, v in scrape(url).items()})
        )

    interceptors = key_interceptors(ctx["key"])
    async with grpc.aio.insecure_channel(address, options=options, interceptors=interceptors) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        prompts = await Prompts.calibrate(stub)
        cl = Client(stub, prompts, plan, http, uuid.uuid4().hex[:8], timed, ctx["key"])
        await cl.one(cl.prompts.text(60, "warm"), plan.first_tokens, "warm")  # first-call costs, untimed
        for name, case in cases(plan):
            if not any(fnmatch.fnmatch(name, w) for w in wanted):
                continue
            if time.monotonic() > ctx["deadline"]:
                ctx["skipped"].append(f"{ctx['backend']}:{name}")
                continue
            row = await case(cl, ctx["backend"])
            if row is None:
                continue
            after = {k: v for url in pages for k, v in scrape(url).items()}
            row["breakdown"] = breakdown(
                before, after, row.pop("client_ttft_mean_ms"), row["engine_ttft_p50_ms"]
            )
            ctx["save_row"](row)


# --- the run --------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    lines = [
        "| case | c | backend | prompt | cached | TTFT p50 | TTFT p95 | engine TTFT p50 | prompt tok/s | extra | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, unit=""):
        return "—" if v is None else f"{v:g}{unit}"

    for r in rows:
        extra = ", ".join(
            f"{k} {r[k]:g}" for k in ("decode_tok_s", "itl_p50_ms", "itl_p95_ms") if r.get(k) is not None
        )
        lines.append(
            f"| {r['case']} | {r['concurrency']} | {r['backend']} | {f(r['prompt_tokens'])} | "
            f"{f(r['cached_tokens'])} | {f(r['ttft_p50_ms'], ' ms')} | {f(r['ttft_p95_ms'], ' ms')} | "
            f"{f(r['engine_ttft_p50_ms'], ' ms')} | {f(r['prompt_tok_s'])} | {extra} | {r['errors']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", default="", help="deploy file (default deploy/h200x2.yaml; --tiny: local-tiny)"
    )
    ap.add_argument("--tiny", action="store_true", help="the tiny sizes and plan (the CPU dry run)")
    ap.add_argument("--backends", default="", help="attention backends, comma-separated, each its own serve")
    ap.add_argument(
        "--cases", default="*", help="the cases to run: names or patterns (prompt_*), comma-separated"
    )
    ap.add_argument("--profile", action="store_true", help="only the short case and its breakdown")
    ap.add_argument(
        "--bursts", default="", help="the text_c<N> cases' sizes, comma-separated (default: the plan's)"
    )
    ap.add_argument(
        "--burst-rounds", type=int, default=0, help="rounds of each text_c<N> (default: the plan's)"
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--checkpoint", default="", help="config-only checkpoint folder (default: a temp dir)")
    ap.add_argument("--checks", default="", help="a JSON file of bench/prefill_check.py to record")
    ap.add_argument(
        "--budget-s", type=float, default=0.0, help="per backend: cases starting later are skipped"
    )
    ap.add_argument(
        "--free-ports", action="store_true", help="every service on a free port (shared machines)"
    )
    ap.add_argument(
        "--attach", action="store_true", help="the pipeline of --config already serves: start none"
    )
    ap.add_argument("--key", default="", help="the gateway's API key, when it asks for one")
    ap.add_argument("--serve-log", default="", help="with --attach: that serve's output (its backend)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--command", default="", help="the command line to record")
    args = ap.parse_args(argv)
    if args.attach and (args.backends or args.checkpoint):
        ap.error("--attach times the running serve: no --backends or --checkpoint")
    args.config = args.config or str(ROOT / "deploy" / ("local-tiny.yaml" if args.tiny else "h200x2.yaml"))
    gpu = not device_name().startswith("cpu") and not args.tiny
    args.backends = [b for b in (args.backends or ("triton,flashinfer" if gpu else "auto")).split(",") if b]
    args.cases = ["short"] if args.profile else [c for c in args.cases.split(",") if c]
    args.results = "prefill_ttft.json" if gpu else "prefill_ttft.dry.json"
    return args


def serve_overrides(args: argparse.Namespace, ckpt: Path) -> list[str]:
    """The run's overrides: the checkpoint, dummy weights, free ports (--free-ports), the caller's --set."""
    if not (ckpt / "config.json").is_file():
        write_config_checkpoint(ckpt, "tiny" if args.tiny else "ming-flash")
    base = [f"model.checkpoint={ckpt}", "model.load_format=dummy"]
    if args.tiny:  # a shared CPU machine: start-up phases may take minutes
        base += [f"startup.phase_deadlines_s.{p}=1200" for p in STARTUP_PHASES] + [
            "startup.heartbeat_timeout_s=600"
        ]
    if args.free_ports:
        base += free_port_overrides(load_config(args.config, base))
    return base + args.overrides


def free_port_overrides(cfg: DeployConfig) -> list[str]:
    """Every port of the deploy file moved to one free now (a shared machine's dry run)."""
    keys = [
        (svc.name, key)
        for svc in cfg.services.values()
        for key in ("port", "admin_port", "metrics_port", "dist_port")
        if getattr(svc, key, 0)
    ]
    keys += [(g.name, "gateway.http_port") for g in cfg.services_of("gateway") if g.gateway.http_port]
    return [
        f"services.{name}.{key}={port}" for (name, key), port in zip(keys, free_ports(len(keys)), strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = TINY if args.tiny else Plan()
    if args.bursts:
        plan = dataclasses.replace(plan, bursts=tuple(int(c) for c in args.bursts.split(",")))
    if args.burst_rounds:
        plan = dataclasses.replace(plan, burst_rounds=args.burst_rounds)
    data = {
        "device": device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": args.command or " ".join(["bench/prefill_ttft.py", *(argv or sys.argv[1:])]),
        "config": os.path.relpath(args.config, ROOT),
        "load_format": "dummy",
        "rows": [],
        "backends": {},
        "skipped": [],
        "checks": json.loads(Path(args.checks).read_text())
        if args.checks and Path(args.checks).is_file()
        else None,
    }

    def save() -> None:
        write_result(out / args.results, data, gpu=args.results == "prefill_ttft.json")
        (out / args.results.replace(".json", ".md")).write_text(table(data["rows"]) + "\n")

    if args.attach:
        cfg = load_config(args.config, args.overrides)
        data["load_format"] = cfg.model.load_format
        address = f"{cfg.host}:{cfg.services_of('gateway')[0].port}"
        serve = ("auto", Path(args.serve_log or os.devnull), time.monotonic())
        time_cases(args, cfg, address, serve, plan, data, save)
    else:
        run_serves(args, plan, data, save)
    print("\n" + table(data["rows"]))
    for r in data["rows"]:
        if r["case"] == "short":
            print(f"breakdown of a short request ({r['backend']}):", json.dumps(r["breakdown"], indent=1))
    failed = [r for r in data["rows"] if r["errors"]]
    for r in failed:  # which errors: a status (HTTP_503, UNAVAILABLE) and the first details
        print(f"errors of {r['case']} ({r['backend']}): {r['errors_by_status']} {r['error_details']}")
    return 1 if failed else 0


def run_serves(args: argparse.Namespace, plan: Plan, data: dict, save) -> None:
    """A serve per attention backend, one after the other (config-only checkpoint, dummy weights)."""
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="ming-config-") as tmp:
        base = serve_overrides(args, Path(args.checkpoint or Path(tmp) / "ckpt"))
        for index, backend in enumerate(args.backends):
            cfg = load_config(args.config, base)
            overrides = base + [
                f"services.{t.name}.engine.attention_backend={backend}" for t in cfg.services_of("thinker")
            ]
            run_one(args, overrides, backend, out / f"prefill_ttft.serve{index}.log", plan, data, save)


def run_one(args, overrides: list[str], asked: str, log: Path, plan: Plan, data: dict, save) -> None:
    """One serve with attention backend `asked`: every case, the profile, the resolved backend."""
    cfg, started = load_config(args.config, overrides), time.monotonic()
    with pipeline(args.config, overrides, log) as address:
        time_cases(args, cfg, address, (asked, log, started), plan, data, save)


def time_cases(args, cfg: DeployConfig, address: str, serve: tuple, plan: Plan, data: dict, save) -> None:
    """Every case against the serving pipeline at `address` (once every replica is admitted); `serve` is
    (the backend asked, the serve's output, when it was started): the backend it resolved, its ready_s."""
    asked, log, started = serve
    missing = wait_all_replicas(gateway_metrics_url(cfg), 300.0)
    ready_s = round(time.monotonic() - started, 1)
    backend = resolved_backend(log, asked)
    print(f"[{asked}] ready in {ready_s} s as {backend}; not admitted: {missing or 'none'}", flush=True)
    data["backends"][asked] = {"resolved": backend, "ready_s": ready_s, "not_admitted": missing}

    def save_row(row: dict) -> None:
        data["rows"].append(row)
        print(table([row]).splitlines()[-1], flush=True)
        save()

    ctx = {
        "backend": backend,
        "deadline": time.monotonic() + (args.budget_s or 1e9),
        "skipped": data["skipped"],
        "save_row": save_row,
        "key": args.key,
    }
    try:
        asyncio.run(run_backend(address, cfg, plan, args.cases, ctx))
    finally:
        data["backends"][asked]["run_s"] = round(time.monotonic() - started - ready_s, 1)
        save()


if __name__ == "__main__":
    sys.exit(main())
