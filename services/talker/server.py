"""TalkerServicer: Speak requests in → a SpeakSession → Speak responses out. No model logic here.

Field errors name the field (`config: required in the first message`); the session names the rest.
A stream takes one of the stress-tested slots for its whole life; none free within
`talker.queue_timeout_s` is RESOURCE_EXHAUSTED with grpc-retry-pushback-ms.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
from omnistage.common.config import TalkerConfig
from omnistage.common.request_ids import MAX_REQUEST_ID_CHARS, valid_request_id
from omnistage.common.runtime.concurrency import ConcurrencyLimiter
from omnistage.common.runtime.errors import InvalidRequest, Overloaded
from omnistage.common.voice_rules import custom_voice_problem
from omnistage.services.talker.session import (
    Chunk,
    Finished,
    SegmentSpoken,
    SpeakSession,
    Started,
    StreamSettings,
    TextInput,
)
from omnistage.v1 import talker_pb2, talker_pb2_grpc


def settings_of(config: talker_pb2.SpeakConfig, cfg: TalkerConfig) -> StreamSettings:
    if not valid_request_id(config.request_id):
        raise InvalidRequest(f"config.request_id: at most {MAX_REQUEST_ID_CHARS} printable characters")
    seed = config.seed if config.HasField("seed") else None
    if config.WhichOneof("voice_source") != "custom_voice":
        return StreamSettings(config.request_id, voice=config.voice, seed=seed)
    custom = config.custom_voice
    if (problem := custom_voice_problem(custom.audio, custom.transcript)) is not None:
        raise InvalidRequest("config." + problem)
    transcript = custom.transcript.strip()
    if len(transcript) > cfg.max_transcript_chars:
        raise InvalidRequest(
            f"config.custom_voice.transcript: {len(transcript)} characters exceed "
            f"talker.max_transcript_chars ({cfg.max_transcript_chars})"
        )
    return StreamSettings(
        config.request_id, custom_audio=custom.audio, custom_transcript=transcript, seed=seed
    )


async def text_inputs(
    first: talker_pb2.SpeakRequest, rest: AsyncIterator[talker_pb2.SpeakRequest]
) -> AsyncIterator[TextInput]:
    yield TextInput(first.text, first.flush, first.end_of_text)
    if first.end_of_text:
        return
    i = 1
    async for message in rest:
        if message.HasField("config"):
            raise InvalidRequest(f"config: only the first message may carry it (message {i} does)")
        yield TextInput(message.text, message.flush, message.end_of_text)
        if message.end_of_text:
            return
        i += 1


def to_proto(event: object) -> talker_pb2.SpeakResponse:
    if isinstance(event, Chunk):
        return talker_pb2.SpeakResponse(
            audio=talker_pb2.SpeechChunk(
                pcm16=event.pcm16, segment_index=event.segment_index, start_sample=event.start_sample
            )
        )
    if isinstance(event, SegmentSpoken):
        return talker_pb2.SpeakResponse(
            segment_done=talker_pb2.SegmentDone(
                segment_index=event.segment_index,
                text=event.text,
                num_samples=event.num_samples,
                steps=event.steps,
                stopped_by_model=event.stopped_by_model,
            )
        )
    if isinstance(event, Started):
        return talker_pb2.SpeakResponse(
            started=talker_pb2.SpeakStarted(
                request_id=event.request_id,
                sample_rate_hz=event.sample_rate_hz,
                channels=1,
                voice=event.voice,
            )
        )
    assert isinstance(event, Finished)
    return talker_pb2.SpeakResponse(
        finished=talker_pb2.SpeakFinished(
            segments=event.segments, total_samples=event.total_samples, first_audio_s=event.first_audio_s
        )
    )


class TalkerServicer(talker_pb2_grpc.TalkerServicer):
    """Speak streams: one `SpeakSession` (from `new_session`, the one the warm-up used) per stream that
    gets one of the `limiter`'s slots."""

    def __init__(
        self,
        new_session: Callable[[], SpeakSession],
        cfg: TalkerConfig,
        limiter: ConcurrencyLimiter,
        service: str = "talker",
    ) -> None:
        self.new_session = new_session
        self.cfg = cfg
        self.limiter = limiter
        self.service = service

    async def Speak(
        self, request_iterator: AsyncIterator[talker_pb2.SpeakRequest], context: grpc.aio.ServicerContext
    ):
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None:
            raise InvalidRequest("config: the stream ended before its first message")
        if not first.HasField("config"):
            raise InvalidRequest("config: required in the first message")
        settings = settings_of(first.config, self.cfg)
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(self.limiter.slot(max(self.cfg.queue_timeout_s, 0.001)))
            except TimeoutError as exc:
                raise Overloaded(f"{self.service}: {exc}", retry_after_ms=500) from None
            session = self.new_session()
            async for event in session.run(settings, text_inputs(first, requests)):
                yield to_proto(event)
