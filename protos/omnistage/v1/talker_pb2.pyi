from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SpeakRequest(_message.Message):
    __slots__ = ("request_id", "voice", "text", "end_of_text")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    END_OF_TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    voice: str
    text: str
    end_of_text: bool
    def __init__(self, request_id: _Optional[str] = ..., voice: _Optional[str] = ..., text: _Optional[str] = ..., end_of_text: _Optional[bool] = ...) -> None: ...

class SpeakResponse(_message.Message):
    __slots__ = ("pcm16", "sample_rate_hz", "segment_index", "last")
    PCM16_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    pcm16: bytes
    sample_rate_hz: int
    segment_index: int
    last: bool
    def __init__(self, pcm16: _Optional[bytes] = ..., sample_rate_hz: _Optional[int] = ..., segment_index: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...
