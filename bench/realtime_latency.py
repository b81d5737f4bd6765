"""Voice to voice through `/v1/realtime`: the user stops speaking → the answer's first audio (issue 38).

    bench/realtime_latency.sh [CONFIG]                   # on the device machine (see that script)
    python bench/realtime_latency.py --tiny              # CPU: deploy/local-tiny.yaml, a smoke run
    python bench/realtime_latency.py --config RUNNING.yaml --attach --tiny   # a serve already running

Starts `omnistage serve` (config-only checkpoint, `load_format: dummy`; the tiny checkpoint with
--tiny; each `--variant`, a comma-separated list of KEY=VALUE overrides, its own serve after the
other: an A/B in one call; with `--attach` none: the pipeline already serving `--config`, e.g. a test's,
as it runs) and, from this process as an outside client speaking the Realtime
protocol's own event names over a plain WebSocket (no SDK: nothing more to carry to a GPU machine),
opens 1, 4, 8, 16 sessions a level. `--start` says when a level's sessions start:
  staggered (the default): session i of N connects i/N of one turn period (the utterance and the
      silence VAD waits for) after the first, so the level's first turns reach the server as spread
      out as its later turns do (those drift apart with their answers): the first turn of a session
      is compared with its later ones under the same load;
  lockstep: every session connects at once and speaks the same utterance, so the level's first
      turns' pauses reach the server within milliseconds of each other: a worst case for the encoder,
      which gets every session's clip at once, and for the first turns (later turns drift apart).
(`sessions_start` in the results.) Each session sets server VAD (`silence_duration_ms` 500) and, turn after turn, streams a
spoken utterance (a speech-like signal Silero hears as speech, made here) at real time in 20 ms
messages, then silence at real time, as a microphone does (each turn's utterance a little quieter than
the last: no two turns hold the same bytes, as with a person). Per turn, on the client's clock:
`input_audio_buffer.speech_stopped` received, the first transcript (or text) delta, the first
`response.output_audio.delta`; then the answer is cancelled (`response.cancel`) and the next turn
starts once its `response.done` came. The first turn of each session is also reported apart from the
later ones (a cold path shows there), on the client's clock and on the gateway's (its
gateway_turn_seconds, whose `turn` label tells a Converse call's first turn from its later ones).

Results, rewritten after every level: OUT/realtime_latency.json = {"device", "date", "command",
"config", "sessions_start", "turn_period_s", "variants", "rows": [{"variant", "sessions", "start", "turns",
"stopped_to_first_audio_p50_ms", "..._p95_ms", "stopped_to_first_text_p50_ms", "first_turn_p50_ms",
"later_turns_p50_ms", "first_turn_text_p50_ms", "later_turns_text_p50_ms", "server_ttft_mean_ms",
"server_ttfa_mean_ms", "server_turn_media_mean_ms", "server_turn_first_text_mean_ms",
"server_first_turn_mean_ms", "server_later_turns_mean_ms", "encode_cache", "encoder_forwards",
"stage_means", "errors"}]} (first_turn_* / later_turns_*: stopped → first audio, and → first text,
p50 over the sessions' first turns / their later turns; server_*: the gateway's own histograms over
the level, from the turn's end at the gateway: its media ready for the thinker (encoded, or found
encoded ahead), its first text, its first audio; server_first_turn_mean_ms / server_later_turns_mean_ms:
{"media", "first_text", "first_audio"} of the sessions' first turns / later turns; encode_cache: what the turns' clips found in the gateway's encode
cache (hit, wait: encoded ahead and still under way, miss: encoded after the commit) and the clips
encoded ahead; stage_means: every service's latency histograms' means over the level,
bench/stage_metrics.py) and OUT/realtime_latency.md. A CPU (or --tiny) run
writes its file only where it holds no GPU run (common/bench_results.py; else give --out).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "load_tests"))
sys.path.insert(0, str(ROOT / "bench"))

from omnistage.common.bench_results import check_result, write_result  # noqa: E402
from omnistage.common.checkpoint.config_only import write_config_checkpoint  # noqa: E402
from omnistage.common.config import DeployConfig, load_config  # noqa: E402
from omnistage.common.load_stats import percentile  # noqa: E402
from pipeline_load import pipeline  # noqa: E402
from pipeline_real_size import device_name, gateway_metrics_url, wait_all_replicas  # noqa: E402
from stage_metrics import counted, means, metric_urls, snapshot  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

from tests.services.gateway.realtime_audio import pcm16, silence, speech_like  # noqa: E402

RATE = 24000
CHUNK_S = 0.02  # 20 ms a message
CHUNK = int(RATE * CHUNK_S) * 2
SILENCE_MS = 500
STARTS = ("staggered", "lockstep")
SESSIONS_START = {
    "staggered": "staggered (session i of N starts i/N of one turn period after the first: a level's "
    "first turns collide no more than its later ones)",
    "lockstep": "together (lockstep, the same utterance: a level's first turns reach the server at once)",
}


@dataclass
class Turn:
    index: int
    stopped: float | None = None
    first_text: float | None = None
    first_audio: float | None = None

    def ms(self, at: float | None) -> float | None:
        return None if at is None or self.stopped is None else (at - self.stopped) * 1000.0


@dataclass
class Session:
    turns: list[Turn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def send(ws, kind: str, **fields) -> None:
    await ws.send(json.dumps({"type": kind, **fields}))


async def microphone(ws, speech: bytes, stop: asyncio.Event) -> None:
    """The utterance, then silence, both at real time (20 ms a message), until `stop`."""
    quiet = silence(CHUNK_S, RATE)
    clock = time.monotonic()
    at = 0
    while not stop.is_set():
        piece = speech[at : at + CHUNK] if at < len(speech) else quiet
        at += CHUNK
        await send(ws, "input_audio_buffer.append", audio=base64.b64encode(piece).decode())
        clock += CHUNK_S
        await asyncio.sleep(max(0.0, clock - time.monotonic()))


async def one_turn(ws, index: int, speech: bytes, timeout_s: float) -> Turn:
    turn, stop = Turn(index), asyncio.Event()
    mic = asyncio.create_task(microphone(ws, speech, stop))
    cancelled = False
    try:
        async with asyncio.timeout(timeout_s):
            async for raw in ws:
                event = json.loads(raw)
                kind, now = event.get("type", ""), time.monotonic()
                if kind == "error":
                    raise RuntimeError(f"error event: {event.get('error')}")
                if kind == "input_audio_buffer.speech_stopped":
                    turn.stopped = now
                elif kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
                    turn.first_text = turn.first_text or now
                elif kind == "response.output_audio.delta" and turn.first_audio is None:
                    turn.first_audio = now
                    if not cancelled:
                        cancelled = True
                        await send(ws, "response.cancel")
                elif kind == "response.done":
                    status = event["response"]["status"]
                    if status == "failed":
                        raise RuntimeError(f"response failed: {event['response'].get('status_details')}")
                    return turn
    finally:
        stop.set()
        await mic
    raise RuntimeError("the socket closed mid-turn")


def turn_speech(speech: bytes, index: int) -> bytes:
    """Turn `index`'s utterance: `speech` 1 % quieter a turn (other bytes, the same VAD decisions)."""
    samples = np.frombuffer(speech, "<i2").astype(np.float32) * (1.0 - 0.01 * (index % 50))
    return samples.astype("<i2").tobytes()


def turn_period_s(speech: bytes) -> float:
    """One turn's length at the microphone: the utterance, then the silence VAD waits for."""
    return len(speech) / 2 / RATE + SILENCE_MS / 1000.0


def start_delays(n: int, start: str, period_s: float) -> list[float]:
    """Seconds after the level's start at which each of its `n` sessions connects (`--start`)."""
    if start not in STARTS:
        raise ValueError(f"start: {start!r}, expected one of {STARTS}")
    return [i * period_s / n if start == "staggered" else 0.0 for i in range(n)]


async def session(
    url: str, key: str, turns: int, speech: bytes, timeout_s: float, delay_s: float = 0.0
) -> Session:
    out = Session()
    await asyncio.sleep(delay_s)
    try:
        async with connect(url, additional_headers={"Authorization": f"Bearer {key}"}, max_size=None) as ws:
            await send(
                ws,
                "session.update",
                session={
                    "type": "realtime",
                    "instructions": "Be brief.",
                    "output_modalities": ["audio"],
                    "audio": {
                        "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": SILENCE_MS}}
                    },
                },
            )
            for i in range(turns):
                out.turns.append(await one_turn(ws, i, turn_speech(speech, i), timeout_s))
    except Exception as exc:  # noqa: BLE001 - a failed session is counted, the level goes on
        out.errors.append(f"{type(exc).__name__}: {exc}"[:300])
    return out


def _p(values: list[float], q: float) -> float | None:
    v = percentile(values, q)
    return None if v is None else round(v, 1)


def server_turns(split: dict[str, float], which: str) -> dict[str, float | None]:
    """The gateway's means of the `which` ("first" / "later") turns' phases over the level."""
    return {
        phase: split.get(f"gateway/gateway_turn_seconds[{phase},{which}]")
        for phase in ("media", "first_text", "first_audio")
    }


async def level(
    url: str,
    key: str,
    metrics: dict[str, str],
    n: int,
    turns: int,
    speech: bytes,
    timeout_s: float,
    start: str = "staggered",
) -> dict:
    before = snapshot(metrics)
    delays = start_delays(n, start, turn_period_s(speech))
    sessions = await asyncio.gather(*(session(url, key, turns, speech, timeout_s, d) for d in delays))
    after = snapshot(metrics)
    split, counts = means(before, after), counted(before, after)
    timed = [t for s in sessions for t in s.turns if t.stopped is not None]

    def ms(first: bool | None, audio: bool = True) -> list[float]:
        """stopped → first audio (or text) of the first turns, the later ones, or all (None)."""
        return [
            ms
            for t in timed
            if first is None or (t.index == 0) == first
            if (ms := t.ms(t.first_audio if audio else t.first_text)) is not None
        ]

    errors = [e for s in sessions for e in s.errors]
    return {
        "sessions": n,
        "start": start,
        "turns": len(timed),
        "stopped_to_first_audio_p50_ms": _p(ms(None), 50),
        "stopped_to_first_audio_p95_ms": _p(ms(None), 95),
        "stopped_to_first_text_p50_ms": _p(ms(None, audio=False), 50),
        "first_turn_p50_ms": _p(ms(True), 50),
        "later_turns_p50_ms": _p(ms(False), 50),
        "first_turn_text_p50_ms": _p(ms(True, audio=False), 50),
        "later_turns_text_p50_ms": _p(ms(False, audio=False), 50),
        "server_ttft_mean_ms": next((v for k, v in split.items() if "gateway_ttft" in k), None),
        "server_ttfa_mean_ms": next((v for k, v in split.items() if "gateway_ttfa" in k), None),
        "server_turn_media_mean_ms": split.get("gateway/gateway_turn_seconds[media]"),
        "server_turn_first_text_mean_ms": split.get("gateway/gateway_turn_seconds[first_text]"),
        "server_first_turn_mean_ms": server_turns(split, "first"),
        "server_later_turns_mean_ms": server_turns(split, "later"),
        "encode_cache": {
            k.split("encode_cache_", 1)[1].replace("_total", ""): v
            for k, v in counts.items()
            if "encode_cache" in k
        },
        "encoder_forwards": {
            k.split("[", 1)[1].rstrip("]"): v for k, v in counts.items() if "encoder_batches_total[" in k
        },
        "stage_means": split,
        "errors": len(errors) + sum(1 for s in sessions for t in s.turns if t.first_audio is None),
        "error_details": errors[:5],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| variant | sessions | start | turns | stopped → first audio p50 | p95 | → first text p50 | first turn p50 "
        "| later turns p50 | server: turn end → media ready | → first text | → first audio (means) "
        "| server, first turns: media / text / audio | later turns | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v) -> str:
        return "—" if v is None else f"{v:g} ms"

    def phases(d: dict | None) -> str:
        d = d or {}
        if all(d.get(p) is None for p in ("media", "first_text", "first_audio")):
            return "—"
        return (
            " / ".join(
                "—" if d.get(p) is None else f"{d[p]:g}" for p in ("media", "first_text", "first_audio")
            )
            + " ms"
        )

    for r in rows:
        lines.append(
            f"| {r.get('variant') or 'as configured'} | {r['sessions']} | {r.get('start', 'lockstep')} | {r['turns']} | "
            f"{f(r['stopped_to_first_audio_p50_ms'])} | "
            f"{f(r['stopped_to_first_audio_p95_ms'])} | {f(r['stopped_to_first_text_p50_ms'])} | "
            f"{f(r['first_turn_p50_ms'])} | {f(r['later_turns_p50_ms'])} | "
            f"{f(r.get('server_turn_media_mean_ms'))} | {f(r.get('server_turn_first_text_mean_ms'))} | "
            f"{f(r['server_ttfa_mean_ms'])} | {phases(r.get('server_first_turn_mean_ms'))} | "
            f"{phases(r.get('server_later_turns_mean_ms'))} | {r['errors']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", default="", help="deploy file (default deploy/h200x2.yaml; --tiny: local-tiny)"
    )
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint, a short plan (CPU smoke run)")
    ap.add_argument("--sessions", default="", help="comma-separated session counts (default 1,4,8,16)")
    ap.add_argument("--turns", type=int, default=0, help="turns per session (default 4; --tiny 2)")
    ap.add_argument(
        "--speech-s",
        type=float,
        default=0.0,
        help="seconds of speech per utterance (default 3.2; --tiny 2: its turn, with VAD's padding and "
        "silence, stays within the tiny encoder's 4 s)",
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help="overrides of one serve, after --set; each variant its own serve, one after the other "
        "(default: one serve as configured)",
    )
    ap.add_argument("--checkpoint", default="", help="config-only checkpoint folder (default: a temp dir)")
    ap.add_argument("--key", default="no-key", help="the HTTP front's API key, when it asks for one")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="one turn's limit")
    ap.add_argument(
        "--start",
        choices=STARTS,
        default="staggered",
        help="when a level's sessions start: staggered (session i of N i/N of one turn period after the "
        "first; the default) or lockstep (all at once: their first turns collide)",
    )
    ap.add_argument(
        "--attach", action="store_true", help="the pipeline of --config already serves: start none"
    )
    ap.add_argument("--out", default=os.environ.get("OUT") or "", help="folder of the results")
    ap.add_argument("--command", default="", help="the command line to record")
    args = ap.parse_args(argv)
    if args.attach and (args.variant or args.checkpoint):
        ap.error("--attach times the running serve as it is: no --variant or --checkpoint")
    args.config = args.config or str(ROOT / "deploy" / ("local-tiny.yaml" if args.tiny else "h200x2.yaml"))
    args.sessions = [int(x) for x in (args.sessions or ("1,2" if args.tiny else "1,4,8,16")).split(",")]
    args.turns = args.turns or (2 if args.tiny else 4)
    args.speech_s = args.speech_s or (2.0 if args.tiny else 3.2)
    return args


def serve_levels(args: argparse.Namespace, overrides: list[str], log: Path, speech: bytes, save) -> dict:
    """One serve with `overrides`: every session level through it, each row saved as it ends; its
    start-up (ready_s, stages not admitted)."""
    started = time.monotonic()
    if args.attach:
        return time_levels(args, load_config(args.config, overrides), speech, save, started)
    with pipeline(args.config, overrides, log):
        return time_levels(args, load_config(args.config, overrides), speech, save, started)


def time_levels(args: argparse.Namespace, cfg: DeployConfig, speech: bytes, save, started: float) -> dict:
    """Every session level through the pipeline of `cfg` (once every replica is admitted), each row
    saved as it ends; its start-up (ready_s since `started`, stages not admitted)."""
    gateway = cfg.services_of("gateway")[0]
    if not gateway.gateway.http_port:
        raise SystemExit(f"{args.config}: the gateway's HTTP front is off (gateway.http_port)")
    url = f"ws://{cfg.host}:{gateway.gateway.http_port}/v1/realtime?model=ming-flash-omni-2.0"
    missing = wait_all_replicas(gateway_metrics_url(cfg), 300.0)
    ready = {"ready_s": round(time.monotonic() - started, 1), "not_admitted": missing}
    print(f"ready in {ready['ready_s']} s; not admitted: {missing or 'none'}", flush=True)
    print(table([]))
    for n in args.sessions:
        row = level(url, args.key, metric_urls(cfg), n, args.turns, speech, args.timeout_s, args.start)
        save(asyncio.run(row))
    return ready


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = device_name()
    gpu = not device.startswith("cpu") and not args.tiny
    out = Path(args.out or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    stem = "realtime_latency"
    check_result(out / f"{stem}.json", gpu=gpu)  # before the run: a CPU run never replaces a GPU record
    speech = silence(0.2, RATE) + pcm16(speech_like(args.speech_s, RATE))
    data = {
        "device": device,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": args.command or " ".join(["bench/realtime_latency.py", *(argv or sys.argv[1:])]),
        "config": os.path.relpath(args.config, ROOT),
        "load_format": "dummy",
        "utterance_s": args.speech_s,
        "silence_duration_ms": SILENCE_MS,
        "sessions_start": SESSIONS_START[args.start],
        "turn_period_s": round(turn_period_s(speech), 3),
        "variants": {},
        "rows": [],
    }
    variant = ""

    def save(row: dict | None = None) -> None:
        if row is not None:
            data["rows"].append({"variant": variant, **row})
            print(table(data["rows"][-1:]).splitlines()[-1], flush=True)
        write_result(out / f"{stem}.json", data, gpu=gpu)
        (out / f"{stem}.md").write_text(table(data["rows"]) + "\n")

    variants = args.variant or [""]
    with tempfile.TemporaryDirectory(prefix="realtime-latency-") as tmp:
        ckpt = Path(args.checkpoint or Path(tmp) / "ckpt")
        overrides = list(args.overrides)
        if args.attach:  # what the running serve loaded
            data["load_format"] = load_config(args.config, overrides).model.load_format
        elif not args.tiny:
            if not (ckpt / "config.json").is_file():
                write_config_checkpoint(ckpt, "ming-flash")
            overrides = [f"model.checkpoint={ckpt}", "model.load_format=dummy", *overrides]
        for index, variant in enumerate(variants):
            print(f"[{variant or 'as configured'}]", flush=True)
            log = out / (f"{stem}.serve.log" if len(variants) == 1 else f"{stem}.serve{index}.log")
            extra = [o for o in variant.split(",") if o]
            data["variants"][variant or "as configured"] = serve_levels(
                args, overrides + extra, log, speech, save
            )
            data["ready_s"] = data["variants"][variant or "as configured"]["ready_s"]
            save()
    print("\n" + table(data["rows"]))
    return 1 if any(r["errors"] for r in data["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
