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

class EncodeItem(_message.Message):
    __slots__ = ("kind", "data", "samples", "sample_rate_hz")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    kind: MediaKind
    data: bytes
    samples: _tensor_pb2.TensorRef
    sample_rate_hz: int
    def __init__(self, kind: _Optional[_Union[MediaKind, str]] = ..., data: _Optional[bytes] = ..., samples: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., sample_rate_hz: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "items")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[EncodeItem]
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[EncodeItem, _Mapping]]] = ...) -> None: ...

class EncodedItem(_message.Message):
    __slots__ = ("embeddings", "num_tokens", "grid_thw")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    embeddings: _tensor_pb2.TensorRef
    num_tokens: int
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, embeddings: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., num_tokens: _Optional[int] = ..., grid_thw: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EncodedItem]
    def __init__(self, items: _Optional[_Iterable[_Union[EncodedItem, _Mapping]]] = ...) -> None: ...
