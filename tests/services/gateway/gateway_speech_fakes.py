"""Fake stages for the gateway's speech tests: a thinker (the ThinkerClient's interface, in process) and a
talker served over real gRPC (the gateway's Speak calls, cancels and deadlines are the real ones)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc
from omnistage.common.runtime.errors import CONTEXT_OVERFLOW, ERROR_REASON_KEY
from omnistage.services.gateway.outputs.talker import SpeechLimits, SpeechStage
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.prompt import render
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.stages import StageError, TalkerClient
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import common_pb2, encoder_pb2, talker_pb2, talker_pb2_grpc, thinker_pb2

RATE = 44100


@dataclass
class ThinkerCall:
    prompt: str
    timeout_s: float | None
    multimodal: list
    closed: bool = False  # the stream was left (finished, cancelled or aborted)
    finished: bool = False


STOP_TOKEN = 99
PROMPT_TOKENS = 7  # what the fake thinker counts of every prompt (its `started` and its finish say so)


class FakeThinker:
    """Streams `answer` (one delta per word, ids 0, 1, ..., `delay_s` apart; with FINISH_REASON_STOP
    then the stop token's delta, as the thinker does), then a finish with `reason`."""

    def __init__(
        self,
        answer: str = "Hello there. How are you today? ",
        delay_s: float = 0.0,
        reason: int = common_pb2.FINISH_REASON_STOP,
        max_user_turns: int = 0,
        refuse: str = "",
    ) -> None:
        self.answer = answer
        self.delay_s = delay_s
        self.reason = reason
        self.max_user_turns = max_user_turns  # > 0: refuse longer prompts as the thinker does (max_model_len)
        self.refuse = refuse  # set: every call is refused (INVALID_ARGUMENT) with these details
        self.calls: list[ThinkerCall] = []

    def error(self, exc: grpc.aio.AioRpcError) -> StageError:  # as ThinkerClient.error of a stage that is up
        return StageError("thinker", exc)

    async def generate(self, request_id, prompt, sampling, timeout_s, multimodal=None):
        call = ThinkerCall(render(prompt), timeout_s, list(multimodal or []))
        self.calls.append(call)
        refusal, trailing = self.refuse, grpc.aio.Metadata()
        if self.max_user_turns and call.prompt.count("<role>HUMAN</role>") > self.max_user_turns:
            refusal = "request 'x': prompt of 2000 tokens leaves no room to generate (max_model_len 1024)"
            trailing = grpc.aio.Metadata((ERROR_REASON_KEY, CONTEXT_OVERFLOW))  # as the thinker says it
        if refusal:
            call.closed = True
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), trailing, details=refusal
            )
        try:
            yield thinker_pb2.ThinkerEvent(
                started=thinker_pb2.Started(engine_request_id="e" * 32, prompt_tokens=PROMPT_TOKENS)
            )
            words = self.answer.split(" ")
            for i, word in enumerate(words):
                await asyncio.sleep(self.delay_s)
                text = word + (" " if i < len(words) - 1 else "")
                if text:
                    yield thinker_pb2.ThinkerEvent(delta=thinker_pb2.TokenDelta(token_ids=[i], text=text))
            if self.reason == common_pb2.FINISH_REASON_STOP:  # the stop token: its id, no text
                yield thinker_pb2.ThinkerEvent(delta=thinker_pb2.TokenDelta(token_ids=[STOP_TOKEN]))
            call.finished = True
            yield thinker_pb2.ThinkerEvent(
                finish=thinker_pb2.ThinkerFinish(
                    reason=self.reason,
                    usage=common_pb2.Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=len(words)),
                )
            )
        finally:
            call.closed = True


@dataclass
class SpeakCall:
    config: talker_pb2.SpeakConfig
    deadline_s: float | None
    texts: list[str] = field(default_factory=list)
    end_of_text: bool = False
    produced: int = 0  # audio chunks yielded
    completed: bool = False  # ended with `finished`
    cancelled: bool = False


class FakeTalker(talker_pb2_grpc.TalkerServicer):
    """Speaks each text message as `chunks_per_text` chunks of `chunk_samples` samples at once.

    mode: "echo" | "refuse-voice" | "busy" (RESOURCE_EXHAUSTED with pushback) | "fail-after-audio"
    (UNAVAILABLE after the first text's audio) | "broken-after-audio" (INTERNAL "Internal error from Core",
    grpc's own status for a write into a broken connection) | "silent" (accepts, then never answers) | "nothing"
    (INVALID_ARGUMENT "text: nothing to speak" at the end). A stream the client cancels after
    `finished`, before the handler returned, counts as cancelled (the real talker's status CANCELLED).
    `speak_delay_s` > 0: each text is spoken that long after it came (a talker slower than the thinker)."""

    def __init__(
        self,
        mode: str = "echo",
        chunks_per_text: int = 1,
        chunk_samples: int = 441,
        end_delay_s: float = 0.0,
        refuse_delay_s: float = 0.0,
        speak_delay_s: float = 0.0,
    ) -> None:
        self.mode = mode
        self.speak_delay_s = speak_delay_s
        self.end_delay_s = end_delay_s  # after `finished`, the handler takes this long to return (cleanup)
        self.refuse_delay_s = refuse_delay_s  # "refuse-voice": the verdict comes this long after the config
        self.chunks_per_text = chunks_per_text
        self.chunk_samples = chunk_samples
        self.calls: list[SpeakCall] = []
        self.active = self.most_active = 0  # Speak calls running now, and the most that ever ran at once

    async def Speak(self, requests, context):
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            async for response in self._speak(requests, context):
                yield response
        finally:
            self.active -= 1

    async def _speak(self, requests, context):
        first = await anext(aiter(requests))
        call = SpeakCall(first.config, context.time_remaining())
        self.calls.append(call)
        if self.mode == "refuse-voice":
            await asyncio.sleep(self.refuse_delay_s)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "config.voice: unknown voice 'nobody' (have: DB30)"
            )
        if self.mode == "busy":
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "talker: no free stream",
                trailing_metadata=(("grpc-retry-pushback-ms", "500"),),
            )
        try:
            voice = "custom" if first.config.HasField("custom_voice") else (first.config.voice or "DB30")
            yield talker_pb2.SpeakResponse(
                started=talker_pb2.SpeakStarted(
                    request_id=first.config.request_id, sample_rate_hz=RATE, channels=1, voice=voice
                )
            )
            segment = 0
            async for message in requests:
                call.texts.append(message.text)
                if message.text and self.mode != "silent":
                    await asyncio.sleep(self.speak_delay_s)
                    for _ in range(self.chunks_per_text):
                        yield talker_pb2.SpeakResponse(
                            audio=talker_pb2.SpeechChunk(
                                pcm16=b"\x01\x00" * self.chunk_samples, segment_index=segment
                            )
                        )
                        call.produced += 1
                    yield talker_pb2.SpeakResponse(segment_done=talker_pb2.SegmentDone(segment_index=segment))
                    segment += 1
                    if self.mode == "fail-after-audio":
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "talker rank 0 died while serving")
                    if self.mode == "broken-after-audio":  # what a client sees writing into a dead connection
                        await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
                if message.end_of_text:
                    call.end_of_text = True
                    break
            if self.mode == "silent":
                await asyncio.sleep(3600)
            if self.mode == "nothing":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text: nothing to speak")
            yield talker_pb2.SpeakResponse(finished=talker_pb2.SpeakFinished(segments=segment))
            await asyncio.sleep(self.end_delay_s)
            call.completed = True
        except (asyncio.CancelledError, GeneratorExit):  # the client cancelled (gRPC closes the handler)
            call.cancelled = True
            raise


class TalkerServer:
    """A FakeTalker on a free local port."""

    def __init__(self, talker: FakeTalker) -> None:
        self.talker = talker
        self.server = grpc.aio.server()
        talker_pb2_grpc.add_TalkerServicer_to_server(talker, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    async def __aenter__(self) -> TalkerServer:
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(0)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class Context:
    """The servicer context of a call: its deadline (None: no deadline)."""

    def __init__(self, remaining_s: float | None = 30.0) -> None:
        self.remaining_s = remaining_s

    def time_remaining(self) -> float | None:
        return self.remaining_s


def gateway(
    thinker: FakeThinker,
    talker_address: str | None,
    *,
    limits: SpeechLimits | None = None,
    max_streams: int = 0,
    media=None,
    converse=None,
    kept=None,
) -> OmniServicer:
    """An OmniServicer over the fakes (talker_address None: no talker deployed)."""
    speech = None
    deployed = {"thinker"}
    if talker_address is not None:
        client = TalkerClient("talker", talker_address, 1 << 22)
        client.max_streams = max_streams
        speech = SpeechStage(client, limits or SpeechLimits(start_wait_s=5.0, idle_timeout_s=5.0), "gw-test")
        deployed.add("talker")
    if media is not None:
        deployed.add("encoder")
    extra = {"converse": converse} if converse is not None else {}
    return OmniServicer(
        Pipeline(
            thinker,
            deployed,
            max_concurrent_requests=8,
            limits=RequestLimits(),
            system_prompt="",
            media=media,
            kept=kept,
            speech=speech,
        ),
        **extra,
    )


async def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def close_quietly(agen) -> None:
    with contextlib.suppress(Exception):
        await agen.aclose()


class FakeMedia:
    """The gateway's MediaStage as Converse uses it: every audio part becomes 3 placeholder rows."""

    max_media_bytes = 1 << 20

    def __init__(self) -> None:
        self.requests: list[list] = []
        self.released: list = []

    async def encode(self, request_id, parts, paths, timeout_s):
        self.requests.append(list(parts))
        return [
            encoder_pb2.EncodedItem(kind=encoder_pb2.MEDIA_KIND_AUDIO, num_tokens=3, placeholder_token_id=99)
            for _ in parts
        ]

    def release(self, items) -> None:
        self.released.extend(items)
