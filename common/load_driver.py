"""Load on a gateway's Omni.Generate, as `omnistage bench` and load_tests/pipeline_load.py send it.

A run is (mode, kind, load): closed (`c` clients, each sending its next request when the last one
ended), offline (every request at once) or poisson (open loop at a rate); kinds text, vision (an
image + text in, text out), speech, image, and mixed (request i is of kind MIXED[i % 4]).
Each request is timed on the client into a `Record`; `run_plan` summarizes each run (load_stats.py).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import io
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from omnistage.common.answer_outcome import answer_code
from omnistage.common.load_stats import Record, Summary, summarize
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

PROMPTS = {
    "text": "Tell me a short story about the moon.",
    "vision": "Describe this picture in detail.",
    "speech": "Say hello and describe the weather today.",
    "image": "A red bicycle leaning on a blue wall.",
}
# The output modality of each single kind.
MODALITY = {
    "text": omni_pb2.MODALITY_TEXT,
    "vision": omni_pb2.MODALITY_TEXT,
    "speech": omni_pb2.MODALITY_AUDIO,
    "image": omni_pb2.MODALITY_IMAGE,
}
MIXED = ("text", "vision", "speech", "image")
KINDS = (*MODALITY, "mixed")
MODES = ("closed", "offline", "poisson")


def kind_of(kind: str, i: int) -> str:
    """The kind of request `i` of a run of `kind` ("mixed" cycles through MIXED)."""
    return MIXED[i % len(MIXED)] if kind == "mixed" else kind


@functools.lru_cache(maxsize=64)
def input_png(side: int, i: int) -> bytes:
    """A smooth side x side PNG, different for every `i` (64 of them cached): a vision request's image."""
    from PIL import Image

    y, x = np.mgrid[0:side, 0:side] / max(side - 1, 1)
    rgb = np.stack([x, y, (x + y + i / 7.0) % 1.0], axis=-1)
    buf = io.BytesIO()
    Image.fromarray((rgb * 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class RequestShape:
    """What every request asks for, and how it is judged."""

    max_tokens: int = 16  # output tokens per request (ignore_eos)
    deadline_s: float = 30.0  # goodput: OK within this many seconds
    timeout_s: float = 300.0  # the gRPC deadline of each request
    image_size: int = 256
    image_steps: int = 4
    input_image_px: int = 512  # side of the input image of a vision request
    prompt: str = ""  # "" = PROMPTS[kind] with each request's own tag (`request_prompt`)
    # The default prompt tagged per request; False: the same prompt for every request (its prefix
    # cached, and greedy answers that are the same tokens: a batch of them routes every sequence to
    # the same experts, reading a fraction of the weights a real batch reads).
    distinct_prompts: bool = True
    metadata: tuple[tuple[str, str], ...] = ()  # call metadata (the API key)


def request_prompt(kind: str, i: int, shape: RequestShape) -> str:
    """Request i's text: `shape.prompt` as given, else the kind's prompt and, with
    `distinct_prompts`, a tag of its own (16 hex digits of its index's hash), so that concurrent
    greedy answers differ as real traffic's do. On 2 x H200 (2026-11-29) one prompt for all gave
    5,083 tok/s at c=32 through serve where the engine on random prompts does 1,763."""
    if shape.prompt:
        return shape.prompt
    if not shape.distinct_prompts:
        return PROMPTS[kind]
    return f"{PROMPTS[kind]} (Request {hashlib.sha256(str(i).encode()).hexdigest()[:16]}.)"


def make_request(kind: str, i: int, shape: RequestShape) -> omni_pb2.GenerateRequest:
    kind = kind_of(kind, i)
    parts = [omni_pb2.ContentPart(text=request_prompt(kind, i, shape))]
    if kind == "vision":
        image = omni_pb2.Media(data=input_png(shape.input_image_px, i % 64), mime_type="image/png")
        parts.insert(0, omni_pb2.ContentPart(image=image))
    req = omni_pb2.GenerateRequest(
        request_id=f"load-{kind}-{i}",
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=parts)],
        output_modalities=[MODALITY[kind]],
        sampling=common_pb2.SamplingParams(max_tokens=shape.max_tokens, ignore_eos=True, seed=i),
    )
    if kind == "image":
        req.image.CopyFrom(
            omni_pb2.ImageOptions(
                width=shape.image_size, height=shape.image_size, steps=shape.image_steps, seed=i
            )
        )
    return req


def finish_code(kind: str, finish: omni_pb2.Finish | None) -> str:
    """ "OK", or why the request does not count as done (see Record.code): answer_outcome's definition,
    the one the gateway's goodput counter uses."""
    return answer_code(finish, spoken=MODALITY[kind] == omni_pb2.MODALITY_AUDIO)


async def one_request(stub: omni_pb2_grpc.OmniStub, kind: str, i: int, shape: RequestShape) -> Record:
    """Send one request and time its events on the client."""
    rec = Record(kind, time.perf_counter(), 0.0, shape.deadline_s)
    finish = None
    try:
        call = stub.Generate(make_request(kind, i, shape), timeout=shape.timeout_s, metadata=shape.metadata)
        async for ev in call:
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
        rec.code = finish_code(kind_of(kind, i), finish)
        if finish is not None:
            rec.completion_tokens = finish.usage.completion_tokens
            rec.detail = "" if rec.ok else (finish.audio.message or finish.message)
    except grpc.aio.AioRpcError as exc:
        rec.code, rec.detail = exc.code().name, exc.details() or ""
    rec.end = time.perf_counter()
    return rec


async def closed_loop(
    stub: omni_pb2_grpc.OmniStub, kind: str, n: int, c: int, shape: RequestShape
) -> list[Record]:
    """`c` clients sharing `n` requests, each sending its next one when the last one ended."""
    ids = iter(range(n))
    records: list[Record] = []

    async def client() -> None:
        for i in ids:
            records.append(await one_request(stub, kind, i, shape))

    await asyncio.gather(*(client() for _ in range(min(c, n))))
    return records


async def poisson(
    stub: omni_pb2_grpc.OmniStub, kind: str, n: int, rate: float, seed: int, shape: RequestShape
) -> list[Record]:
    """Open loop: `n` arrivals with exponential gaps at `rate`/s, never waiting for replies."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one_request(stub, kind, i, shape)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def plan(
    kinds: Iterable[str], modes: Iterable[str], concurrency: Iterable[int], rates: Iterable[float] = ()
) -> Iterator[tuple[str, str, str]]:
    """(mode, kind, load) of every run, in the order they run."""
    modes, concurrency, rates = list(modes), list(concurrency), list(rates)
    for kind in kinds:
        for mode in modes:
            if mode == "closed":
                yield from ((mode, kind, str(c)) for c in concurrency)
            elif mode == "offline":
                yield mode, kind, "all"
            else:
                yield from ((mode, kind, f"{r:g}/s") for r in rates)


async def run_plan(
    stub: omni_pb2_grpc.OmniStub,
    runs: Sequence[tuple[str, str, str]],
    requests: int,
    shape: RequestShape,
    *,
    seed: int = 0,
    on_summary: Callable[[Summary], None] | None = None,
) -> list[Summary]:
    """Every run of `runs` (`requests` requests each, at least the concurrency), after one unmeasured
    request per kind (connections and first-call costs); a Summary per run."""
    for first in dict.fromkeys(k for _, kind, _ in runs for k in (MIXED if kind == "mixed" else (kind,))):
        await one_request(stub, first, 0, shape)
    summaries = []
    for mode, kind, load in runs:
        started = time.perf_counter()
        if mode == "closed":
            records = await closed_loop(stub, kind, max(requests, int(load)), int(load), shape)
        elif mode == "offline":
            records = await closed_loop(stub, kind, requests, requests, shape)
        else:
            records = await poisson(stub, kind, requests, float(load.removesuffix("/s")), seed, shape)
        summary = summarize(mode, kind, load, records, time.perf_counter() - started)
        if on_summary is not None:
            on_summary(summary)
        summaries.append(summary)
    return summaries
