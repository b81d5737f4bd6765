from omnistage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MediaKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIA_KIND_UNSPECIFIED: _ClassVar[MediaKind]
    MEDIA_KIND_IMAGE: _ClassVar[MediaKind]
    MEDIA_KIND_AUDIO: _ClassVar[MediaKind]
    MEDIA_KIND_VIDEO: _ClassVar[MediaKind]
MEDIA_KIND_UNSPECIFIED: MediaKind
MEDIA_KIND_IMAGE: MediaKind
MEDIA_KIND_AUDIO: MediaKind
MEDIA_KIND_VIDEO: MediaKind

class VideoFrames(_message.Message):
    __slots__ = ("images", "fps")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    fps: float
    def __init__(self, images: _Optional[_Iterable[bytes]] = ..., fps: _Optional[float] = ...) -> None: ...

class EncodeItem(_message.Message):
    __slots__ = ("kind", "data", "samples", "frames", "sample_rate_hz")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    kind: MediaKind
    data: bytes
    samples: _tensor_pb2.TensorRef
    frames: VideoFrames
    sample_rate_hz: int
    def __init__(self, kind: _Optional[_Union[MediaKind, str]] = ..., data: _Optional[bytes] = ..., samples: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., frames: _Optional[_Union[VideoFrames, _Mapping]] = ..., sample_rate_hz: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "items", "consumer_host_id", "allow_cuda_ipc")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOW_CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[EncodeItem]
    consumer_host_id: str
    allow_cuda_ipc: bool
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[EncodeItem, _Mapping]]] = ..., consumer_host_id: _Optional[str] = ..., allow_cuda_ipc: _Optional[bool] = ...) -> None: ...

class GridTHW(_message.Message):
    __slots__ = ("t", "h", "w")
    T_FIELD_NUMBER: _ClassVar[int]
    H_FIELD_NUMBER: _ClassVar[int]
    W_FIELD_NUMBER: _ClassVar[int]
    t: int
    h: int
    w: int
    def __init__(self, t: _Optional[int] = ..., h: _Optional[int] = ..., w: _Optional[int] = ...) -> None: ...

class EncodedItem(_message.Message):
    __slots__ = ("kind", "embeddings", "num_tokens", "placeholder_token_id", "merged_grids", "timestamps_s", "duration_s", "resized_height", "resized_width")
    KIND_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MERGED_GRIDS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMPS_S_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    RESIZED_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    RESIZED_WIDTH_FIELD_NUMBER: _ClassVar[int]
    kind: MediaKind
    embeddings: _tensor_pb2.TensorRef
    num_tokens: int
    placeholder_token_id: int
    merged_grids: _containers.RepeatedCompositeFieldContainer[GridTHW]
    timestamps_s: _containers.RepeatedScalarFieldContainer[float]
    duration_s: float
    resized_height: int
    resized_width: int
    def __init__(self, kind: _Optional[_Union[MediaKind, str]] = ..., embeddings: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., num_tokens: _Optional[int] = ..., placeholder_token_id: _Optional[int] = ..., merged_grids: _Optional[_Iterable[_Union[GridTHW, _Mapping]]] = ..., timestamps_s: _Optional[_Iterable[float]] = ..., duration_s: _Optional[float] = ..., resized_height: _Optional[int] = ..., resized_width: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("items", "spatial_merge_size")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_MERGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EncodedItem]
    spatial_merge_size: int
    def __init__(self, items: _Optional[_Iterable[_Union[EncodedItem, _Mapping]]] = ..., spatial_merge_size: _Optional[int] = ...) -> None: ...
