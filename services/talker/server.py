"""TalkerServicer: Speak requests in → the engine's Speak stream → Speak responses out. No model logic
and no admission here: field errors name the field (`config: required in the first message`), the
engine does the rest (its stream slots, the session's own errors)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import grpc
from omnistage.common.config import TalkerConfig
from omnistage.common.request_ids import MAX_REQUEST_ID_CHARS, valid_request_id
from omnistage.common.runtime.deadlines import deadline_after
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.voice_rules import custom_voice_problem
from omnistage.services.talker.request_flow import (
    Chunk,
    Finished,
    SegmentSpoken,
    Started,
    StreamSettings,
    TalkerEngine,
    TextInput,
)
from omnistage.v1 import talker_pb2, talker_pb2_grpc


def settings_of(
    config: talker_pb2.SpeakConfig, cfg: TalkerConfig, time_remaining: float | None = None
) -> StreamSettings:
    """The stream's settings from its first message; `time_remaining`: the call's deadline (None: none)."""
    return dataclasses.replace(_settings(config, cfg), deadline=deadline_after(time_remaining))


def _settings(config: talker_pb2.SpeakConfig, cfg: TalkerConfig) -> StreamSettings:
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
                text_end=event.text_end,
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
    """Speak streams, each through `TalkerEngine.speak`."""

    def __init__(self, engine: TalkerEngine, cfg: TalkerConfig) -> None:
        self.engine = engine
        self.cfg = cfg

    async def Speak(
        self, request_iterator: AsyncIterator[talker_pb2.SpeakRequest], context: grpc.aio.ServicerContext
    ):
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None:
            raise InvalidRequest("config: the stream ended before its first message")
        if not first.HasField("config"):
            raise InvalidRequest("config: required in the first message")
        settings = settings_of(first.config, self.cfg, context.time_remaining())
        async for event in self.engine.speak(settings, text_inputs(first, requests)):
            yield to_proto(event)
