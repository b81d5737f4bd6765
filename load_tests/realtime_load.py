"""Voice agents under load: concurrent Realtime sessions (GET /v1/realtime, the official `openai`
client) with audio both ways, then every gauge back to 0.

python load_tests/realtime_load.py [--config deploy/local-tiny.yaml] [--set KEY.PATH=VALUE ...]
                                   [--http http://127.0.0.1:7153] [--metrics http://127.0.0.1:9451/metrics]
                                   [--concurrency 1,8,16] [--duration-s 30] [--key KEY] [--talk-over]

Starts `omnistage serve` (or uses the gateway whose HTTP front is at --http when --no-serve), then for
each concurrency c opens c sessions at once, each with server VAD, for --duration-s seconds: a
microphone paced in real time (100 ms appends) says an utterance (a speech-like signal Silero hears as
speech, tests/services/gateway/realtime_audio.py) and pauses, again and again: after the answer is
done (the microphone sends silence meanwhile), or with --talk-over at once, over the answer (barge-ins).
Times on the client:
  turn latency   `input_audio_buffer.speech_stopped` received → the response's first
                 `response.output_audio.delta` (the VAD's speech end to the first audio)
and counts responses by `response.done` status, `error` events, and what was lost (a speech end with no
commit, a response other than the last with no `response.done`). After each level the gateway's
realtime gauges and every service's requests in flight must be back to 0 (exit 1 otherwise, and on any
error or loss).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from load_tests.speech_load import _pct, _serve  # noqa: E402
from tests.services.gateway.realtime_audio import silence, utterance  # noqa: E402

CHUNK = 4800  # 100 ms of PCM16 at 24 kHz


@dataclass
class SessionStats:
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    audio_bytes: int = 0
    seen: Counter = field(default_factory=Counter)  # events by type

    def lost(self) -> str:
        """'' when every speech end was committed and every response but the last one (open when the
        session ended) was done; else what went missing."""
        s = self.seen
        if s["input_audio_buffer.committed"] != s["input_audio_buffer.speech_stopped"]:
            return f"{s['input_audio_buffer.speech_stopped']} speech ends, {s['input_audio_buffer.committed']} commits"
        if not 0 <= s["response.created"] - s["response.done"] <= 1:
            return f"{s['response.created']} responses created, {s['response.done']} done"
        return ""


async def _microphone(conn, stop: float, answered: asyncio.Event | None) -> None:
    """Always on, in real time: an utterance, then silence until its answer is done (`answered`; None:
    the next utterance comes at once, over the answer)."""
    said = utterance(0.8, 0.2, 1.2)  # speech, then a pause long enough to end the turn
    quiet = base64.b64encode(silence(0.1)).decode()
    while time.monotonic() < stop:
        if answered is not None:
            answered.clear()
        for at in range(0, len(said), CHUNK):
            await conn.input_audio_buffer.append(audio=base64.b64encode(said[at : at + CHUNK]).decode())
            await asyncio.sleep(0.1)
        while answered is not None and not answered.is_set() and time.monotonic() < stop:
            await conn.input_audio_buffer.append(audio=quiet)
            await asyncio.sleep(0.1)


async def _listen(conn, stats: SessionStats, answered: asyncio.Event) -> None:
    stopped_at: float | None = None
    first_audio: set[str] = set()
    async for event in conn:
        kind = event.type
        stats.seen[kind] += 1
        if kind == "input_audio_buffer.speech_stopped":
            stopped_at = time.monotonic()
        elif kind == "response.output_audio.delta":
            stats.audio_bytes += len(event.delta) * 3 // 4
            if event.response_id not in first_audio and stopped_at is not None:
                first_audio.add(event.response_id)
                stats.latencies_s.append(time.monotonic() - stopped_at)
        elif kind == "response.done":
            stats.statuses[event.response.status] += 1
            answered.set()
        elif kind == "error":
            stats.errors.append(f"{event.error.code}: {event.error.message}")


async def _session(http: str, key: str, model: str, duration_s: float, talk_over: bool) -> SessionStats:
    stats, answered = SessionStats(), asyncio.Event()
    client = openai.AsyncOpenAI(base_url=http + "/v1", api_key=key, max_retries=0)
    async with client.realtime.connect(model=model) as conn:
        await conn.session.update(
            session={
                "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 400}}}
            }
        )
        listener = asyncio.create_task(_listen(conn, stats, answered))
        await _microphone(conn, time.monotonic() + duration_s, None if talk_over else answered)
        await asyncio.sleep(2.0)  # the last answer starts
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    return stats


def _gauges(metrics_url: str) -> dict[str, float]:
    found = {}
    for line in urllib.request.urlopen(metrics_url, timeout=5).read().decode().splitlines():
        name = line.split("{", 1)[0]
        if name in ("omnistage_gateway_realtime_sessions", "omnistage_gateway_realtime_responses_active"):
            found[name] = float(line.rsplit(" ", 1)[1])
        elif name == "omnistage_rpc_in_flight":
            found[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return found


async def _level(args, c: int) -> str:
    runs = await asyncio.gather(
        *(_session(args.http, args.key, args.model, args.duration_s, args.talk_over) for _ in range(c)),
        return_exceptions=True,
    )
    failed = [r for r in runs if isinstance(r, BaseException)]
    stats = [r for r in runs if isinstance(r, SessionStats)]
    lat = [x * 1000 for s in stats for x in s.latencies_s]
    statuses = sum((s.statuses for s in stats), Counter())
    errors = [e for s in stats for e in s.errors] + [lost for s in stats if (lost := s.lost())]
    deadline = time.monotonic() + 60
    left = _gauges(args.metrics)
    while any(left.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        left = _gauges(args.metrics)
    stuck = {k: v for k, v in left.items() if v}
    timing = f"{_pct(lat, 0.5):.0f} | {_pct(lat, 0.95):.0f}" if lat else "– | –"
    detail = ", ".join(f"{n} {k}" for k, n in sorted(statuses.items()))
    line = (
        f"| {c} | {len(stats)}/{c} | {len(lat)} | {timing} | {detail} | "
        f"{sum(s.audio_bytes for s in stats) / 48000:.0f} | {len(errors)} | {stuck or 'all 0'} |"
    )
    if failed or errors or stuck:
        print(line, file=sys.stderr)
        raise SystemExit(
            f"concurrency {c}: sessions failed {failed[:1]!r}, errors {errors[:3]}, left {stuck}"
        )
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deploy/local-tiny.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    ap.add_argument("--no-serve", action="store_true", help="use the gateway already serving --http")
    ap.add_argument("--http", default="http://127.0.0.1:7153")
    ap.add_argument("--metrics", default="http://127.0.0.1:9451/metrics")
    ap.add_argument("--model", default="ming-flash-omni-2.0")
    ap.add_argument("--key", default="no-key")
    ap.add_argument("--concurrency", default="1,8,16")
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument(
        "--talk-over",
        action="store_true",
        help="speak again at once, over the answer (barge-ins), not after it",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="realtime-load-") as tmp:
        proc = None if args.no_serve else _serve(args.config, args.overrides, Path(tmp))[0]
        try:
            print(
                "| sessions | ended cleanly | turns timed | speech end → first audio p50 ms | p95 ms "
                "| responses | audio s received | errors + lost | gauges after |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            for c in (int(x) for x in args.concurrency.split(",")):
                print(asyncio.run(_level(args, c)), flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)


if __name__ == "__main__":
    main()
