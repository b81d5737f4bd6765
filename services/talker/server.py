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
    Event,
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


# Each flow event as the SpeakResponse field that carries it: a message with the event's fields.
_RESPONSE_FIELDS = {
    Started: ("started", talker_pb2.SpeakStarted),
    Chunk: ("audio", talker_pb2.SpeechChunk),
    SegmentSpoken: ("segment_done", talker_pb2.SegmentDone),
    Finished: ("finished", talker_pb2.SpeakFinished),
}


def to_proto(event: Event) -> talker_pb2.SpeakResponse:
    field, message = _RESPONSE_FIELDS[type(event)]
    values = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    if isinstance(event, Started):
        values["channels"] = 1  # the talker speaks mono
    return talker_pb2.SpeakResponse(**{field: message(**values)})


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
