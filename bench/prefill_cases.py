"""The cases of bench/prefill_ttft.py: requests sent as an outside client (gRPC Omni.Generate, or the
OpenAI HTTP front), each timed to its first token, and the row each case makes.

The first token is the answer's first TextDelta (gRPC), or the first chunk of its stream (HTTP: the
front answers once the Omni call's first event, that TextDelta, has come). Its text may be empty: a
special token, or a UTF-8 character not complete yet, is held back, and the random weights of a dry
run often draw only such tokens (timed to its first visible text, a short answer of the tiny model
had none one time in four, and counted as an error).

A `Sample` is one request as the client saw it, with what its Finish says the thinker did (prompt
tokens, tokens taken from the prefix cache, the engine's own TTFT). Prompts of a given length are
words calibrated once through Omni.Tokenize; a unique nonce opens every prompt that must not hit the
prefix cache, a fixed prompt is sent once untimed before its `_cached` runs.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from omnistage.common.load_driver import input_png
from omnistage.common.load_stats import percentile
from omnistage.services.encoder.startup import wav_bytes
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

WORDS = (
    "river stone light garden window morning quiet paper engine silver market winter story travel "
    "orange bridge forest cloud number simple animal summer letter doctor island mirror planet "
    "village yellow circle hammer candle pocket"
).split()


# The keys issue 39 asks of every row (bench/results/prefill_ttft.json).
ROW_KEYS = (
    "case",
    "concurrency",
    "prompt_tokens",
    "cached_tokens",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "prompt_tok_s",
    "backend",
)


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (TINY: the CPU dry run)."""

    short_requests: int = 20
    http_requests: int = 10
    sizes: tuple[tuple[str, int], ...] = (("1k", 1050), ("5k", 5030))
    new_requests: tuple[int, ...] = (5, 3)  # per size
    cached_requests: int = 5
    bursts: tuple[int, ...] = (8, 32)
    burst_rounds: int = 2
    burst_tokens: int = 256
    image_px: int = 1024
    audio_s: float = 3.0
    media_requests: int = 3
    itl_streams: int = 16
    itl_tokens: int = 400
    itl_prompts: int = 3
    itl_gap_s: float = 0.8
    first_tokens: int = 8  # max_tokens of the TTFT cases: the first token is what is timed
    timeout_s: float = 120.0


TINY = Plan(
    short_requests=3,
    http_requests=2,
    sizes=(("1k", 200), ("5k", 600)),
    new_requests=(2, 1),
    cached_requests=2,
    bursts=(4, 8),
    burst_rounds=1,
    burst_tokens=8,
    image_px=256,
    media_requests=1,
    itl_streams=2,
    itl_tokens=24,
    itl_prompts=1,
    itl_gap_s=0.2,
    first_tokens=4,
    timeout_s=300.0,
)


@dataclass
class Sample:
    """One request as the client saw it (seconds from its send) and what its Finish reported."""

    start: float = 0.0
    ttft_s: float | None = None
    end: float = 0.0
    deltas: list[float] = field(default_factory=list)  # client times (perf_counter) of its text deltas
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    engine_ttft_ms: float = 0.0
    code: str = "OK"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.code == "OK" and self.ttft_s is not None


# --- prompts ---------------------------------------------------------------------------------------


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def text_request(text: str, max_tokens: int, rid: str, parts: tuple = ()) -> omni_pb2.GenerateRequest:
    content = [*parts, omni_pb2.ContentPart(text=text)]
    return omni_pb2.GenerateRequest(
        request_id=rid,
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=content)],
        output_modalities=[omni_pb2.MODALITY_TEXT],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


class Prompts:
    """Texts of about `tokens` prompt tokens (chat markup included), from one calibration."""

    def __init__(self, overhead: float, per_word: float) -> None:
        self.overhead, self.per_word = overhead, per_word

    @classmethod
    async def calibrate(cls, stub: omni_pb2_grpc.OmniStub) -> Prompts:
        counts = []
        for n in (20, 80):  # small enough for the tiny model's byte-level tokenizer and context
            resp = await stub.Tokenize(text_request(words(n, 0), 1, "calibrate"), timeout=60)
            counts.append(len(resp.token_ids))
        per_word = (counts[1] - counts[0]) / 60
        return cls(counts[0] - 20 * per_word, per_word)

    def text(self, tokens: int, nonce: str, seed: int = 1) -> str:
        """`nonce` first (a unique one keeps the prompt out of the prefix cache), then the words."""
        head = f"[{nonce}] " if nonce else ""
        n = max(1, math.floor((tokens - self.overhead - 4) / self.per_word))
        return head + words(n, seed)


def media_part(kind: str, plan: Plan, i: int) -> omni_pb2.ContentPart:
    if kind == "image":
        png = input_png(plan.image_px, i % 64)
        return omni_pb2.ContentPart(image=omni_pb2.Media(data=png, mime_type="image/png"))
    audio = wav_bytes(
        plan.audio_s, freq_hz=180 + 23 * i
    )  # a pitch of its own: no two clips share cached rows
    return omni_pb2.ContentPart(audio=omni_pb2.Media(data=audio, mime_type="audio/wav"))


# --- one request -----------------------------------------------------------------------------------


async def generate(stub: omni_pb2_grpc.OmniStub, req: omni_pb2.GenerateRequest, timeout_s: float) -> Sample:
    """Send `req` and time its text deltas; the Finish's usage goes into the sample."""
    s = Sample(start=time.perf_counter())
    finish = None
    try:
        async for ev in stub.Generate(req, timeout=timeout_s):
            which = ev.WhichOneof("event")
            if which == "text":  # a token (its text may be held back)
                now = time.perf_counter()
                s.deltas.append(now)
                s.ttft_s = now - s.start if s.ttft_s is None else s.ttft_s
            elif which == "finish":
                finish = ev.finish
        if finish is None:
            s.code = "NO_FINISH"
        else:
            u = finish.usage
            s.prompt_tokens, s.cached_tokens = u.prompt_tokens, u.cached_prompt_tokens
            s.completion_tokens, s.engine_ttft_ms = u.completion_tokens, u.time_to_first_token_ms
    except grpc.aio.AioRpcError as exc:
        s.code, s.detail = exc.code().name, (exc.details() or "")[:300]
    s.end = time.perf_counter()
    return s


def http_chat(host: str, port: int, text: str, max_tokens: int, timeout_s: float, key: str = "") -> Sample:
    """One streaming chat completion through the OpenAI front (blocking: run it in a thread); `key` is
    the front's API key, when it asks for one."""
    body = json.dumps(
        {
            "model": "omnistage",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    s = Sample(start=time.perf_counter())
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        conn.request("POST", "/v1/chat/completions", body, headers)
        resp = conn.getresponse()
        if resp.status != 200:
            s.code, s.detail = f"HTTP_{resp.status}", resp.read(300).decode(errors="replace")
            return s
        for line in resp:
            _sse_line(s, line)
        if s.code == "OK" and not s.completion_tokens:  # the usage chunk (include_usage) ends an answer
            s.code = "NO_FINISH"
    except OSError as exc:
        s.code, s.detail = "HTTP_ERROR", str(exc)[:300]
    finally:
        conn.close()
        s.end = time.perf_counter()
    return s


def _sse_line(s: Sample, line: bytes) -> None:
    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
        return
    chunk = json.loads(line[6:])
    now = time.perf_counter()
    s.ttft_s = now - s.start if s.ttft_s is None else s.ttft_s  # the first chunk: the first token came
    error = chunk.get("error")
    if error:  # the stream's failure (its status was 200 already)
        s.code = f"SSE_{error.get('code') or error.get('type') or 'error'}"
        s.detail = str(error.get("message", ""))[:300]
        return
    if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
        s.deltas.append(now)
    usage = chunk.get("usage")
    if usage:
        s.prompt_tokens = usage.get("prompt_tokens", 0)
        s.completion_tokens = usage.get("completion_tokens", 0)
        s.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0


# --- rows ------------------------------------------------------------------------------------------


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 1)


def row(case: str, c: int, samples: list[Sample], backend: str, **extra) -> dict:
    """The issue's keys from the OK samples: TTFT percentiles (client view), the median prompt and
    cached tokens, and prompt tokens computed per second of TTFT (c = 1: the median over requests; a
    burst: the new tokens of all its requests over its longest TTFT)."""
    ok = [s for s in samples if s.ok]
    ttfts = [s.ttft_s for s in ok]
    new = [s.prompt_tokens - s.cached_tokens for s in ok]
    if not ok:
        rate = None
    elif c == 1:
        rate = statistics.median(n / t for n, t in zip(new, ttfts, strict=True) if t > 0)
    else:
        rate = sum(new) / max(ttfts)
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            errors[s.code] = errors.get(s.code, 0) + 1
    return {
        "case": case,
        "concurrency": c,
        "prompt_tokens": int(statistics.median(s.prompt_tokens for s in ok)) if ok else None,
        "cached_tokens": int(statistics.median(s.cached_tokens for s in ok)) if ok else None,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p95_ms": _ms(percentile(ttfts, 95)),
        "prompt_tok_s": None if rate is None else round(rate, 1),
        "backend": backend,
        "requests": len(samples),
        "errors": sum(errors.values()),
        "errors_by_status": errors,
        "error_details": sorted({s.detail for s in samples if not s.ok and s.detail})[:3],
        "engine_ttft_p50_ms": round(statistics.median(s.engine_ttft_ms for s in ok), 1) if ok else None,
        "client_ttft_mean_ms": _ms(statistics.fmean(ttfts)) if ok else None,
        **extra,
    }


def inter_token_gaps(samples: list[Sample]) -> list[float]:
    """Seconds between consecutive text deltas of each stream, after its first."""
    return [b - a for s in samples for a, b in zip(s.deltas, s.deltas[1:], strict=False)]


# --- cases -----------------------------------------------------------------------------------------


@dataclass
class Client:
    """What every case needs: the stub, the calibrated prompts, the plan, where the HTTP front is, and
    `timed()`, which a case awaits where its timed part starts (after what it sends untimed), and the
    API key of the HTTP front, when it asks for one (the gRPC channel presents it itself)."""

    stub: omni_pb2_grpc.OmniStub
    prompts: Prompts
    plan: Plan
    http: tuple[str, int] | None
    nonce: str  # this run's: prompts of another run (another backend) never hit this one's cache
    timed: Callable[[], Awaitable[None]] = field(default=lambda: asyncio.sleep(0))
    key: str = ""

    async def one(self, text: str, max_tokens: int, rid: str, parts: tuple = ()) -> Sample:
        return await generate(self.stub, text_request(text, max_tokens, rid, parts), self.plan.timeout_s)


Case = Callable[[Client, str], Awaitable[dict | None]]


async def short(cl: Client, backend: str) -> dict:
    """A ~60-token chat prompt, a new prefix each time, c = 1."""
    p = cl.plan
    await cl.timed()
    samples = [
        await cl.one(cl.prompts.text(60, f"{cl.nonce}-s{i}"), p.first_tokens, f"short-{i}")
        for i in range(p.short_requests)
    ]
    return row("short", 1, samples, backend)


async def short_http(cl: Client, backend: str) -> dict | None:
    """The same through the OpenAI HTTP front (streaming)."""
    if cl.http is None:
        return None
    p, (host, port) = cl.plan, cl.http
    await cl.timed()
    samples = []
    for i in range(p.http_requests):
        text = cl.prompts.text(60, f"{cl.nonce}-h{i}")
        samples.append(
            await asyncio.to_thread(http_chat, host, port, text, p.first_tokens, p.timeout_s, cl.key)
        )
    return row("short_http", 1, samples, backend)


async def new_prompts(cl: Client, backend: str, name: str, tokens: int, n: int) -> dict:
    """prompt_<size>: a new prefix each time, c = 1."""
    await cl.timed()
    samples = [
        await cl.one(cl.prompts.text(tokens, f"{cl.nonce}-{name}-{i}"), cl.plan.first_tokens, f"{name}-{i}")
        for i in range(n)
    ]
    return row(f"prompt_{name}", 1, samples, backend)


async def cached_prompts(cl: Client, backend: str, name: str, tokens: int) -> dict:
    """prompt_<size>_cached: one prompt sent once untimed (its prefix computed), then again and again."""
    p = cl.plan
    fixed = cl.prompts.text(tokens, f"{cl.nonce}-{name}-fixed")
    await cl.one(fixed, p.first_tokens, f"{name}-seed")
    await cl.timed()
    samples = [await cl.one(fixed, p.first_tokens, f"{name}-c{i}") for i in range(p.cached_requests)]
    return row(f"prompt_{name}_cached", 1, samples, backend)


async def burst(cl: Client, backend: str, c: int) -> dict:
    """text_c<c>: c short prompts sent at once, `burst_rounds` times; the decode rate of each round."""
    p = cl.plan
    await cl.timed()
    samples, rates = [], []
    for r in range(p.burst_rounds):
        texts = [cl.prompts.text(60, f"{cl.nonce}-b{c}-{r}-{i}") for i in range(c)]
        got = await asyncio.gather(
            *(cl.one(t, p.burst_tokens, f"burst-{c}-{i}") for i, t in enumerate(texts))
        )
        wall = max(s.end for s in got) - min(s.start for s in got)
        rates.append(sum(s.completion_tokens for s in got) / wall)
        samples += got
    return row(f"text_c{c}", c, samples, backend, decode_tok_s=round(statistics.median(rates), 1))


async def media(cl: Client, backend: str, kind: str, case: str) -> dict:
    """image_<px> (a PNG, a new one each time) or audio_<s>s (a WAV), with a question, c = 1."""
    p = cl.plan
    question = "What is in this picture?" if kind == "image" else "What do you hear?"
    await cl.timed()
    samples = [
        await cl.one(
            f"{question} ({cl.nonce}-{kind}{i})", p.first_tokens, f"{kind}-{i}", (media_part(kind, p, i),)
        )
        for i in range(p.media_requests)
    ]
    return row(case, 1, samples, backend)


async def itl_under_long_prompts(cl: Client, backend: str) -> dict:
    """itl_<size>: `itl_streams` streams decode while `itl_prompts` prompts of the largest size arrive
    `itl_gap_s` apart; the streams' inter-token gaps (p50, p95, max) beside the long prompts' TTFT."""
    p = cl.plan
    name, tokens = p.sizes[-1]
    await cl.timed()
    streams = [
        asyncio.create_task(cl.one(cl.prompts.text(60, f"{cl.nonce}-itl{i}"), p.itl_tokens, f"itl-{i}"))
        for i in range(p.itl_streams)
    ]
    await asyncio.sleep(2 * p.itl_gap_s)  # every stream decoding
    longs = []
    for i in range(p.itl_prompts):
        text = cl.prompts.text(tokens, f"{cl.nonce}-itlp{i}")
        longs.append(asyncio.create_task(cl.one(text, p.first_tokens, f"itlp-{i}")))
        await asyncio.sleep(p.itl_gap_s)
    long_samples = await asyncio.gather(*longs)
    gaps = inter_token_gaps([s for s in await asyncio.gather(*streams) if s.ok])
    extra = {"itl_p50_ms": _ms(percentile(gaps, 50)), "itl_p95_ms": _ms(percentile(gaps, 95))}
    extra |= {"itl_max_ms": _ms(max(gaps)) if gaps else None, "streams": p.itl_streams}
    return row(f"itl_{name}", 1, list(long_samples), backend, **extra)


def cases(plan: Plan) -> list[tuple[str, Case]]:
    """Every case of a run, in order, by the name its row gets."""
    out: list[tuple[str, Case]] = [("short", short), ("short_http", short_http)]
    for (name, tokens), n in zip(plan.sizes, plan.new_requests, strict=True):
        out.append((f"prompt_{name}", functools.partial(new_prompts, name=name, tokens=tokens, n=n)))
        out.append((f"prompt_{name}_cached", functools.partial(cached_prompts, name=name, tokens=tokens)))
    out += [(f"text_c{c}", functools.partial(burst, c=c)) for c in plan.bursts]
    image, audio = f"image_{plan.image_px}", f"audio_{plan.audio_s:g}s"
    out += [(image, functools.partial(media, kind="image", case=image))]
    out += [(audio, functools.partial(media, kind="audio", case=audio))]
    return out + [(f"itl_{plan.sizes[-1][0]}", itl_under_long_prompts)]
