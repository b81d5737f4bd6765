from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeakRequest(_message.Message):
    __slots__ = ("config", "text", "flush", "end_of_text")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    END_OF_TEXT_FIELD_NUMBER: _ClassVar[int]
    config: SpeakConfig
    text: str
    flush: bool
    end_of_text: bool
    def __init__(self, config: _Optional[_Union[SpeakConfig, _Mapping]] = ..., text: _Optional[str] = ..., flush: _Optional[bool] = ..., end_of_text: _Optional[bool] = ...) -> None: ...

class SpeakConfig(_message.Message):
    __slots__ = ("request_id", "voice", "custom_voice", "seed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_VOICE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    voice: str
    custom_voice: CustomVoice
    seed: int
    def __init__(self, request_id: _Optional[str] = ..., voice: _Optional[str] = ..., custom_voice: _Optional[_Union[CustomVoice, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class CustomVoice(_message.Message):
    __slots__ = ("audio", "transcript")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    transcript: str
    def __init__(self, audio: _Optional[bytes] = ..., transcript: _Optional[str] = ...) -> None: ...

class SpeakStarted(_message.Message):
    __slots__ = ("request_id", "sample_rate_hz", "channels", "voice")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_rate_hz: int
    channels: int
    voice: str
    def __init__(self, request_id: _Optional[str] = ..., sample_rate_hz: _Optional[int] = ..., channels: _Optional[int] = ..., voice: _Optional[str] = ...) -> None: ...

class SpeechChunk(_message.Message):
    __slots__ = ("pcm16", "segment_index", "start_sample")
    PCM16_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    START_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    pcm16: bytes
    segment_index: int
    start_sample: int
    def __init__(self, pcm16: _Optional[bytes] = ..., segment_index: _Optional[int] = ..., start_sample: _Optional[int] = ...) -> None: ...

class SegmentDone(_message.Message):
    __slots__ = ("segment_index", "text", "num_samples", "steps", "stopped_by_model", "text_end")
    SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_BY_MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_END_FIELD_NUMBER: _ClassVar[int]
    segment_index: int
    text: str
    num_samples: int
    steps: int
    stopped_by_model: bool
    text_end: int
    def __init__(self, segment_index: _Optional[int] = ..., text: _Optional[str] = ..., num_samples: _Optional[int] = ..., steps: _Optional[int] = ..., stopped_by_model: _Optional[bool] = ..., text_end: _Optional[int] = ...) -> None: ...

class SpeakFinished(_message.Message):
    __slots__ = ("segments", "total_samples", "first_audio_s")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIRST_AUDIO_S_FIELD_NUMBER: _ClassVar[int]
    segments: int
    total_samples: int
    first_audio_s: float
    def __init__(self, segments: _Optional[int] = ..., total_samples: _Optional[int] = ..., first_audio_s: _Optional[float] = ...) -> None: ...

class SpeakResponse(_message.Message):
    __slots__ = ("started", "audio", "segment_done", "finished")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_DONE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    started: SpeakStarted
    audio: SpeechChunk
    segment_done: SegmentDone
    finished: SpeakFinished
    def __init__(self, started: _Optional[_Union[SpeakStarted, _Mapping]] = ..., audio: _Optional[_Union[SpeechChunk, _Mapping]] = ..., segment_done: _Optional[_Union[SegmentDone, _Mapping]] = ..., finished: _Optional[_Union[SpeakFinished, _Mapping]] = ...) -> None: ...
