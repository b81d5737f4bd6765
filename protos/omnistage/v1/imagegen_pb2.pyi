from omnistage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageGenRequest(_message.Message):
    __slots__ = ("request_id", "condition", "width", "height", "steps", "guidance_scale", "seed", "prompt_text")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    condition: _tensor_pb2.TensorRef
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    prompt_text: str
    def __init__(self, request_id: _Optional[str] = ..., condition: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class ImageGenEvent(_message.Message):
    __slots__ = ("step", "png", "total_steps")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PNG_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    png: bytes
    total_steps: int
    def __init__(self, step: _Optional[int] = ..., png: _Optional[bytes] = ..., total_steps: _Optional[int] = ...) -> None: ...
