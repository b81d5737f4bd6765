"""Time to first audio and stages that share a GPU, measured through `omnistage serve` (issue 35).

    bench/pipeline_latency.sh [CONFIG]                    # on the device machine (see that script)
    python bench/pipeline_latency.py --config deploy/h100x4.yaml --variant mps=off --variant mps=on
    python bench/pipeline_latency.py --tiny               # CPU: deploy/local-tiny.yaml, tiny sizes

Each `--variant` (a name=value list of `serve` overrides: `mps=off` is `devices.mps.mode=off`; any other
key=value is passed as it is) starts its own `omnistage serve` (config-only checkpoint, `load_format:
dummy`) and runs, from this process as an outside gRPC client (greedy, ignore_eos):

    speech             text + audio, 64 new tokens, c = 1 4 16: TTFA p50/p95, TTFT, the thinker's
                       per-stream decode rate (first to last text delta), RTF
    text_under_speech  one text stream (256 new tokens) alone, then while 16 spoken answers run
                       (its rate first to last text delta; `text_alone_tok_s` the rate alone, same run)
    mixed              text, vision, speech and image requests in turn at c = 16; the text requests'
                       per-stream rate beside the text-only rate at c = 16 (`text_alone_tok_s`)

Results, rewritten after every row: OUT/pipeline_latency.json = {"device", "date", "command", "rows":
[{kind, concurrency, placement, mps, ttfa_p50_ms, ttfa_p95_ms, ttft_p50_ms, stream_decode_tok_s,
text_alone_tok_s, rtf_mean, errors, ...}]} and OUT/pipeline_latency.md; each variant's serve log
beside them. Random weights: the words are noise (and so, unpunctuated), the time is the release's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "load_tests"))
sys.path.insert(0, str(ROOT / "bench"))

from omnistage.common.bench_results import refusal, write_result  # noqa: E402
from omnistage.common.checkpoint.config_only import write_config_checkpoint  # noqa: E402
from omnistage.common.config import DeployConfig, load_config  # noqa: E402
from omnistage.common.load_driver import RequestShape, closed_loop, kind_of, one_request  # noqa: E402
from omnistage.common.load_stats import Record, percentile  # noqa: E402
from omnistage.v1 import omni_pb2_grpc  # noqa: E402
from pipeline_load import pipeline  # noqa: E402
from pipeline_real_size import cli, device_name, gateway_metrics_url, wait_all_replicas  # noqa: E402
from stage_metrics import means, metric_urls, snapshot  # noqa: E402

ALIASES = {"mps": "devices.mps.mode"}
ROWS = ("speech", "text_under_speech", "mixed")


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: concurrency levels, tokens, requests."""

    speech_levels: tuple[int, ...] = (1, 4, 16)
    speech_rounds: int = 2  # spoken requests per level: max(3, rounds x concurrency)
    speech_tokens: int = 64
    text_tokens: int = 256
    under_speech: int = 16  # spoken answers running while the text stream is timed
    text_streams: int = 3  # text streams timed alone and under speech (the median is the row's)
    mixed_c: int = 16
    image_size: int = 1024
    image_steps: int = 30
    input_image_px: int = 512


TINY = Plan(
    speech_levels=(1, 2),
    speech_tokens=8,
    text_tokens=16,
    under_speech=2,
    text_streams=2,
    mixed_c=4,
    image_size=256,
    image_steps=4,
    input_image_px=128,
)


def stream_rate(rec: Record) -> float | None:
    """A stream's decode rate, tokens per second from its first to its last text delta."""
    tpot = rec.tpot_s
    return 1.0 / tpot if tpot else None


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def _ms(values: list[float], q: float) -> float | None:
    v = percentile(values, q)
    return None if v is None else round(v * 1000.0, 1)


def latency_row(kind: str, c: int, records: list[Record], **extra) -> dict:
    """One row: TTFA / TTFT percentiles, the median per-stream decode rate, RTF, errors."""
    ok = [r for r in records if r.ok]
    rates = [x for r in ok if (x := stream_rate(r)) is not None]
    rtfs = [x for r in ok if (x := r.rtf) is not None]
    errors: dict[str, int] = {}
    details: dict[str, str] = {}
    for r in records:
        if not r.ok:
            errors[r.code] = errors.get(r.code, 0) + 1
            details.setdefault(r.code, r.detail[:300])
    return {
        "kind": kind,
        "concurrency": c,
        "requests": len(records),
        "ttfa_p50_ms": _ms([r.first_audio_s for r in ok if r.first_audio_s is not None], 50),
        "ttfa_p95_ms": _ms([r.first_audio_s for r in ok if r.first_audio_s is not None], 95),
        "ttft_p50_ms": _ms([r.first_text_s for r in ok if r.first_text_s is not None], 50),
        "ttft_p95_ms": _ms([r.first_text_s for r in ok if r.first_text_s is not None], 95),
        "stream_decode_tok_s": _median(rates),
        "rtf_mean": round(statistics.fmean(rtfs), 3) if rtfs else None,
        "errors": sum(errors.values()),
        "errors_by_status": errors,
        "error_details": details,
        **extra,
    }


async def streams_alone(stub, n: int, shape: RequestShape) -> list[Record]:
    return [await one_request(stub, "text", 1000 + i, shape) for i in range(n)]


async def streams_under_speech(stub, n: int, shape: RequestShape, speaking: int, speech: RequestShape):
    """`n` text streams one after another while `speaking` clients keep spoken answers running."""
    stop = asyncio.Event()
    spoken: list[Record] = []

    async def speaker(k: int) -> None:
        i = 0
        while not stop.is_set():
            spoken.append(await one_request(stub, "speech", 10_000 * (k + 1) + i, speech))
            i += 1

    speakers = [asyncio.create_task(speaker(k)) for k in range(speaking)]
    await asyncio.sleep(2.0)  # every speaker has its answer under way
    try:
        timed = [await one_request(stub, "text", 2000 + i, shape) for i in range(n)]
    finally:
        stop.set()
        await asyncio.gather(*speakers)
    return timed, spoken


async def mixed_loop(stub, n: int, c: int, shape: RequestShape) -> list[Record]:
    """`c` clients sharing `n` requests of the mixed kinds in turn, each record under its own kind."""
    ids = iter(range(n))
    records: list[Record] = []

    async def client() -> None:
        for i in ids:
            records.append(await one_request(stub, kind_of("mixed", i), i, shape))

    await asyncio.gather(*(client() for _ in range(min(c, n))))
    return records


async def run_rows(
    address: str,
    plan: Plan,
    timeout_s: float,
    base: dict,
    save,
    rows=ROWS,
    metrics: dict[str, str] | None = None,
) -> None:
    shape = RequestShape(
        max_tokens=plan.text_tokens,
        deadline_s=timeout_s,
        timeout_s=timeout_s,
        image_size=plan.image_size,
        image_steps=plan.image_steps,
        input_image_px=plan.input_image_px,
    )
    speech = replace(shape, max_tokens=plan.speech_tokens)
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        for kind in ("text", "speech", "vision", "image"):  # first-call costs, unmeasured
            rec = await one_request(stub, kind, 0, speech)
            print(f"first {kind} request: {rec.code} in {rec.e2e_s:.1f} s", flush=True)
        for c in plan.speech_levels if "speech" in rows else ():
            before = snapshot(metrics or {})
            records = await closed_loop(stub, "speech", max(3, plan.speech_rounds * c), c, speech)
            save(
                latency_row("speech", c, records, stage_means=means(before, snapshot(metrics or {})), **base)
            )
        if "text_under_speech" in rows:
            await text_under_speech(stub, plan, shape, speech, base, save)
        if "mixed" in rows:
            await mixed_row(stub, plan, speech, base, save)


async def text_under_speech(stub, plan: Plan, shape: RequestShape, speech: RequestShape, base: dict, save):
    alone = await streams_alone(stub, plan.text_streams, shape)
    timed, spoken = await streams_under_speech(stub, plan.text_streams, shape, plan.under_speech, speech)
    alone_rate = latency_row("text", 1, alone)["stream_decode_tok_s"]
    row = latency_row("text_under_speech", 1, timed, text_alone_tok_s=alone_rate, **base)
    under = latency_row("speech", plan.under_speech, spoken)
    row |= {"speakers": plan.under_speech, "speech_errors": under["errors"], "rtf_mean": under["rtf_mean"]}
    if alone_rate and row["stream_decode_tok_s"]:
        row["ratio"] = round(row["stream_decode_tok_s"] / alone_rate, 3)
    save(row)


async def mixed_row(stub, plan: Plan, speech: RequestShape, base: dict, save) -> None:
    c = plan.mixed_c
    text_only = await closed_loop(stub, "text", 2 * c, c, speech)
    mixed = await mixed_loop(stub, 2 * c, c, speech)
    text_rate = latency_row("text", c, text_only)["stream_decode_tok_s"]
    row = latency_row("mixed", c, mixed, text_alone_tok_s=text_rate, **base)
    mixed_text = latency_row("text", c, [r for r in mixed if r.kind == "text"])["stream_decode_tok_s"]
    row |= {"stream_decode_tok_s": mixed_text}
    if text_rate and mixed_text:
        row["ratio"] = round(mixed_text / text_rate, 3)
    save(row)


def latency_metrics(url: str) -> list[str]:
    """The gateway's latency histograms' sums and counts (TTFT, TTFA, the talker's side), for the profile."""
    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except (OSError, ValueError) as exc:
        return [f"unreadable: {exc}"]
    keep = ("ttft", "ttfa", "first", "queue", "admission")
    return [
        line
        for line in text.splitlines()
        if not line.startswith("#") and any(k in line for k in keep) and ("_sum" in line or "_count" in line)
    ]


def table(rows: list[dict]) -> str:
    lines = [
        "| kind | c | placement | MPS | TTFA p50 | TTFA p95 | TTFT p50 | stream tok/s | alone tok/s | RTF | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, unit=""):
        return "—" if v is None else f"{v:g}{unit}"

    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['concurrency']} | {r['placement']} | {r['mps']} | {f(r['ttfa_p50_ms'], ' ms')} | "
            f"{f(r['ttfa_p95_ms'], ' ms')} | {f(r['ttft_p50_ms'], ' ms')} | {f(r['stream_decode_tok_s'])} | "
            f"{f(r.get('text_alone_tok_s'))} | {f(r['rtf_mean'])} | {r['errors']} |"
        )
    return "\n".join(lines)


def variant_overrides(text: str, cfg: DeployConfig) -> tuple[list[str], set[str]]:
    """A variant's serve overrides and the rows it runs (all unless `only=` names them with '+').

    Aliases: `mps=MODE` (devices.mps.mode); `first=off` (every talker's first segment unbounded: the
    reference's rule, waiting for a mark), `first=N` (its bound in words); `lead=SECONDS` (every talker's
    realtime_lead_s); `<kind>_sm=PCT` (the mps_active_thread_percentage of every service of that kind)."""
    out: list[str] = []
    rows = set(ROWS)
    talkers = [s.name for s in cfg.services_of("talker")]
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key == "only":
            rows = set(value.split("+"))
        elif key == "first" and value == "off":
            out += [
                f"services.{t}.talker.first_segment_max_{k}=0" for t in talkers for k in ("pieces", "wait_s")
            ]
        elif key == "first":
            out += [f"services.{t}.talker.first_segment_max_pieces={value}" for t in talkers]
        elif key == "lead":
            out += [f"services.{t}.talker.realtime_lead_s={value}" for t in talkers]
        elif key.endswith("_prio"):  # talker_prio=below_normal: that kind's MPS client priority
            kind = key.removesuffix("_prio")
            out += [f"services.{x.name}.mps_client_priority={value}" for x in cfg.services_of(kind)]
        elif key.endswith("_sm"):  # talker_sm, imagegen_sm, encoder_sm: that kind's SM share
            kind = key.removesuffix("_sm")
            out += [f"services.{x.name}.mps_active_thread_percentage={value}" for x in cfg.services_of(kind)]
        else:
            out.append(f"{ALIASES.get(key, key)}={value}")
    return out, rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", default="", help="deploy file (default deploy/h100x4.yaml; --tiny: local-tiny)"
    )
    ap.add_argument("--tiny", action="store_true", help="the tiny sizes and a small plan (CPU)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="serve overrides of one run, comma-separated key=value (mps=off|on|auto is devices.mps.mode); "
        "repeatable, each its own serve (default: one run as the deploy file says)",
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--checkpoint", default="", help="config-only checkpoint folder (default: a temp dir)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="gRPC deadline of each request")
    ap.add_argument(
        "--speech-levels", default="", help="comma-separated concurrencies of the speech row (default 1,4,16)"
    )
    ap.add_argument(
        "--speech-rounds",
        type=int,
        default=2,
        help="spoken requests per level: max(3, rounds x concurrency) (a paced answer lasts its audio)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--command", default="", help="the command line to record")
    args = ap.parse_args(argv)
    args.config = args.config or str(ROOT / "deploy" / ("local-tiny.yaml" if args.tiny else "h100x4.yaml"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = TINY if args.tiny else Plan()
    if args.speech_levels:
        plan = replace(plan, speech_levels=tuple(int(c) for c in args.speech_levels.split(",")))
    plan = replace(plan, speech_rounds=args.speech_rounds)
    data = {
        "device": device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": args.command or " ".join(["bench/pipeline_latency.py", *(argv or sys.argv[1:])]),
        "config": os.path.relpath(args.config, ROOT),
        "load_format": "dummy",
        "rows": [],
        "variants": {},
    }

    gpu = not data["device"].startswith("cpu") and not args.tiny
    save_refusal = refusal(out / "pipeline_latency.json", gpu=gpu)
    if save_refusal:  # before the runs, not after them
        print(f"pipeline_latency: {save_refusal}", file=sys.stderr)
        return 2

    def save(row: dict | None = None) -> None:
        if row is not None:
            data["rows"].append(row)
            print(table([row]).splitlines()[-1], flush=True)
        write_result(out / "pipeline_latency.json", data, gpu=gpu)
        (out / "pipeline_latency.md").write_text(table(data["rows"]) + "\n")

    with tempfile.TemporaryDirectory(prefix="ming-config-") as tmp:
        ckpt = Path(args.checkpoint or Path(tmp) / "ckpt")
        if not (ckpt / "config.json").is_file():
            write_config_checkpoint(ckpt, "tiny" if args.tiny else "ming-flash")
        base_overrides = [f"model.checkpoint={ckpt}", "model.load_format=dummy", *args.overrides]
        cfg = load_config(args.config, base_overrides)
        base_overrides += [f"services.{g.name}.gateway.http_port=0" for g in cfg.services_of("gateway")]
        for index, text in enumerate(args.variant or [""]):
            extra, rows = variant_overrides(text, cfg)
            overrides = base_overrides + extra
            cfg = load_config(args.config, overrides)
            base = {"placement": Path(args.config).name, "mps": cfg.devices.mps.mode, "variant": text}
            log = out / f"pipeline_latency.serve{index}.log"
            started = time.monotonic()
            with pipeline(args.config, overrides, log) as address:
                missing = wait_all_replicas(gateway_metrics_url(cfg), 300.0)
                ready_s = round(time.monotonic() - started, 1)
                print(f"[{text or 'as configured'}] ready in {ready_s} s; not admitted: {missing or 'none'}")
                data["variants"][text or "default"] = {"ready_s": ready_s, "not_admitted": missing}
                try:
                    asyncio.run(run_rows(address, plan, args.timeout_s, base, save, rows, metric_urls(cfg)))
                finally:
                    data["variants"][text or "default"]["gateway_metrics"] = latency_metrics(
                        gateway_metrics_url(cfg)
                    )
                    status = cli("status", "--config", args.config, *(f"--set={o}" for o in overrides))
                    data["variants"][text or "default"]["status"] = status.stdout.strip()[-4000:]
                    save()
    print("\n" + table(data["rows"]))
    return 1 if any(r["errors"] or r.get("speech_errors") for r in data["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
