from omnistage.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_TEXT: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SYSTEM: _ClassVar[Role]
    ROLE_USER: _ClassVar[Role]
    ROLE_ASSISTANT: _ClassVar[Role]
    ROLE_TOOL: _ClassVar[Role]

class ToolChoice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_AUTO: _ClassVar[ToolChoice]
    TOOL_CHOICE_NONE: _ClassVar[ToolChoice]
    TOOL_CHOICE_REQUIRED: _ClassVar[ToolChoice]
    TOOL_CHOICE_FUNCTION: _ClassVar[ToolChoice]

class AudioOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_OUTCOME_UNSPECIFIED: _ClassVar[AudioOutcome]
    AUDIO_OUTCOME_COMPLETE: _ClassVar[AudioOutcome]
    AUDIO_OUTCOME_PARTIAL: _ClassVar[AudioOutcome]
    AUDIO_OUTCOME_NONE: _ClassVar[AudioOutcome]
MODALITY_UNSPECIFIED: Modality
MODALITY_TEXT: Modality
MODALITY_AUDIO: Modality
MODALITY_IMAGE: Modality
ROLE_UNSPECIFIED: Role
ROLE_SYSTEM: Role
ROLE_USER: Role
ROLE_ASSISTANT: Role
ROLE_TOOL: Role
TOOL_CHOICE_AUTO: ToolChoice
TOOL_CHOICE_NONE: ToolChoice
TOOL_CHOICE_REQUIRED: ToolChoice
TOOL_CHOICE_FUNCTION: ToolChoice
AUDIO_OUTCOME_UNSPECIFIED: AudioOutcome
AUDIO_OUTCOME_COMPLETE: AudioOutcome
AUDIO_OUTCOME_PARTIAL: AudioOutcome
AUDIO_OUTCOME_NONE: AudioOutcome

class Media(_message.Message):
    __slots__ = ("data", "path", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    path: str
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., path: _Optional[str] = ..., mime_type: _Optional[str] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image", "audio", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Media
    audio: Media
    video: Media
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Media, _Mapping]] = ..., audio: _Optional[_Union[Media, _Mapping]] = ..., video: _Optional[_Union[Media, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "parts", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: Role
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class ImageOptions(_message.Message):
    __slots__ = ("width", "height", "steps", "guidance_scale", "seed", "edit")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EDIT_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    edit: bool
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ..., steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., edit: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "messages", "output_modalities", "sampling", "voice", "image", "system_prompt", "custom_voice", "tools", "tool_choice", "tool_choice_function", "prompt", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODALITIES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_VOICE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    output_modalities: _containers.RepeatedScalarFieldContainer[Modality]
    sampling: _common_pb2.SamplingParams
    voice: str
    image: ImageOptions
    system_prompt: str
    custom_voice: VoiceClip
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    tool_choice_function: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., output_modalities: _Optional[_Iterable[_Union[Modality, str]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., voice: _Optional[str] = ..., image: _Optional[_Union[ImageOptions, _Mapping]] = ..., system_prompt: _Optional[str] = ..., custom_voice: _Optional[_Union[VoiceClip, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, str]] = ..., tool_choice_function: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VoiceClip(_message.Message):
    __slots__ = ("audio", "transcript")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    transcript: str
    def __init__(self, audio: _Optional[bytes] = ..., transcript: _Optional[str] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class AudioChunk(_message.Message):
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

class ImageResult(_message.Message):
    __slots__ = ("png", "width", "height")
    PNG_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    png: bytes
    width: int
    height: int
    def __init__(self, png: _Optional[bytes] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("stage", "done", "total")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    stage: str
    done: int
    total: int
    def __init__(self, stage: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class AudioStatus(_message.Message):
    __slots__ = ("outcome", "code", "message", "retry_after_ms", "voice", "segments", "samples", "sample_rate_hz", "time_to_first_audio_ms")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_AUDIO_MS_FIELD_NUMBER: _ClassVar[int]
    outcome: AudioOutcome
    code: str
    message: str
    retry_after_ms: int
    voice: str
    segments: int
    samples: int
    sample_rate_hz: int
    time_to_first_audio_ms: float
    def __init__(self, outcome: _Optional[_Union[AudioOutcome, str]] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., voice: _Optional[str] = ..., segments: _Optional[int] = ..., samples: _Optional[int] = ..., sample_rate_hz: _Optional[int] = ..., time_to_first_audio_ms: _Optional[float] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("reason", "usage", "message", "audio")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    message: str
    audio: AudioStatus
    def __init__(self, reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., message: _Optional[str] = ..., audio: _Optional[_Union[AudioStatus, _Mapping]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("request_id", "text", "audio", "image", "progress", "finish", "tool_call", "turn")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: TextDelta
    audio: AudioChunk
    image: ImageResult
    progress: Progress
    finish: Finish
    tool_call: ToolCall
    turn: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[_Union[TextDelta, _Mapping]] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., image: _Optional[_Union[ImageResult, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCall, _Mapping]] = ..., turn: _Optional[int] = ...) -> None: ...

class ConverseRequest(_message.Message):
    __slots__ = ("config", "text", "audio", "end_of_turn", "cancel")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    END_OF_TURN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    config: GenerateRequest
    text: str
    audio: AudioChunk
    end_of_turn: bool
    cancel: bool
    def __init__(self, config: _Optional[_Union[GenerateRequest, _Mapping]] = ..., text: _Optional[str] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., end_of_turn: _Optional[bool] = ..., cancel: _Optional[bool] = ...) -> None: ...
