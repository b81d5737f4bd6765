from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_KIND_UNSPECIFIED: _ClassVar[StageKind]
    STAGE_KIND_GATEWAY: _ClassVar[StageKind]
    STAGE_KIND_THINKER: _ClassVar[StageKind]
    STAGE_KIND_ENCODER: _ClassVar[StageKind]
    STAGE_KIND_TALKER: _ClassVar[StageKind]
    STAGE_KIND_IMAGEGEN: _ClassVar[StageKind]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_STARTING: _ClassVar[Phase]
    PHASE_LOADING_WEIGHTS: _ClassVar[Phase]
    PHASE_PROFILING_MEMORY: _ClassVar[Phase]
    PHASE_WARMING_UP: _ClassVar[Phase]
    PHASE_CAPTURING_GRAPHS: _ClassVar[Phase]
    PHASE_SERVING: _ClassVar[Phase]
    PHASE_DRAINING: _ClassVar[Phase]
    PHASE_STOPPED: _ClassVar[Phase]
    PHASE_FAILED: _ClassVar[Phase]
STAGE_KIND_UNSPECIFIED: StageKind
STAGE_KIND_GATEWAY: StageKind
STAGE_KIND_THINKER: StageKind
STAGE_KIND_ENCODER: StageKind
STAGE_KIND_TALKER: StageKind
STAGE_KIND_IMAGEGEN: StageKind
PHASE_UNSPECIFIED: Phase
PHASE_STARTING: Phase
PHASE_LOADING_WEIGHTS: Phase
PHASE_PROFILING_MEMORY: Phase
PHASE_WARMING_UP: Phase
PHASE_CAPTURING_GRAPHS: Phase
PHASE_SERVING: Phase
PHASE_DRAINING: Phase
PHASE_STOPPED: Phase
PHASE_FAILED: Phase

class PhaseProgress(_message.Message):
    __slots__ = ("phase", "done", "total", "unit", "detail", "updated_unix_ms", "elapsed_s")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    done: int
    total: int
    unit: str
    detail: str
    updated_unix_ms: int
    elapsed_s: float
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., unit: _Optional[str] = ..., detail: _Optional[str] = ..., updated_unix_ms: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class MemoryReport(_message.Message):
    __slots__ = ("device", "budget_bytes", "weights_bytes", "kv_cache_bytes", "activation_peak_bytes", "graph_pool_bytes", "transport_pool_bytes", "total_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRAPH_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    budget_bytes: int
    weights_bytes: int
    kv_cache_bytes: int
    activation_peak_bytes: int
    graph_pool_bytes: int
    transport_pool_bytes: int
    total_bytes: int
    def __init__(self, device: _Optional[str] = ..., budget_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., activation_peak_bytes: _Optional[int] = ..., graph_pool_bytes: _Optional[int] = ..., transport_pool_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_running_requests", "max_queued_requests", "max_message_bytes", "max_prompt_tokens", "max_model_len", "default_max_tokens", "max_vision_batch_items", "max_audio_batch_items", "max_items_per_request", "min_image_side_px", "max_image_side_px", "max_denoising_steps", "max_image_batch", "max_step_batch", "realtime_lead_ms", "decode_step_times")
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_VISION_BATCH_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_AUDIO_BATCH_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MIN_IMAGE_SIDE_PX_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_SIDE_PX_FIELD_NUMBER: _ClassVar[int]
    MAX_DENOISING_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_BATCH_FIELD_NUMBER: _ClassVar[int]
    REALTIME_LEAD_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    max_running_requests: int
    max_queued_requests: int
    max_message_bytes: int
    max_prompt_tokens: int
    max_model_len: int
    default_max_tokens: int
    max_vision_batch_items: int
    max_audio_batch_items: int
    max_items_per_request: int
    min_image_side_px: int
    max_image_side_px: int
    max_denoising_steps: int
    max_image_batch: int
    max_step_batch: int
    realtime_lead_ms: int
    decode_step_times: _containers.RepeatedCompositeFieldContainer[DecodeStepTime]
    def __init__(self, max_running_requests: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., max_vision_batch_items: _Optional[int] = ..., max_audio_batch_items: _Optional[int] = ..., max_items_per_request: _Optional[int] = ..., min_image_side_px: _Optional[int] = ..., max_image_side_px: _Optional[int] = ..., max_denoising_steps: _Optional[int] = ..., max_image_batch: _Optional[int] = ..., max_step_batch: _Optional[int] = ..., realtime_lead_ms: _Optional[int] = ..., decode_step_times: _Optional[_Iterable[_Union[DecodeStepTime, _Mapping]]] = ...) -> None: ...

class DecodeStepTime(_message.Message):
    __slots__ = ("sequences", "context_tokens", "seconds")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    sequences: int
    context_tokens: int
    seconds: float
    def __init__(self, sequences: _Optional[int] = ..., context_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("name", "kind", "version", "model", "rank", "world_size", "progress", "memory", "limits", "config_hash", "running_requests", "queued_requests", "failure", "pid", "readiness")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    READINESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: StageKind
    version: str
    model: str
    rank: int
    world_size: int
    progress: PhaseProgress
    memory: _containers.RepeatedCompositeFieldContainer[MemoryReport]
    limits: Limits
    config_hash: str
    running_requests: int
    queued_requests: int
    failure: str
    pid: int
    readiness: _containers.RepeatedCompositeFieldContainer[Readiness]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[StageKind, str]] = ..., version: _Optional[str] = ..., model: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., progress: _Optional[_Union[PhaseProgress, _Mapping]] = ..., memory: _Optional[_Iterable[_Union[MemoryReport, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., config_hash: _Optional[str] = ..., running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., failure: _Optional[str] = ..., pid: _Optional[int] = ..., readiness: _Optional[_Iterable[_Union[Readiness, _Mapping]]] = ...) -> None: ...

class Readiness(_message.Message):
    __slots__ = ("capability", "ready", "reason")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    capability: str
    ready: bool
    reason: str
    def __init__(self, capability: _Optional[str] = ..., ready: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("deadline_ms",)
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    deadline_ms: int
    def __init__(self, deadline_ms: _Optional[int] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("completed", "aborted")
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    completed: int
    aborted: int
    def __init__(self, completed: _Optional[int] = ..., aborted: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("phase",)
    PHASE_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ...) -> None: ...
