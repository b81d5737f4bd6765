from omnistage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageGenRequest(_message.Message):
    __slots__ = ("request_id", "condition", "width", "height", "steps", "guidance_scale", "seed", "prompt_text", "reference_image")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_IMAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    condition: _tensor_pb2.TensorRef
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    prompt_text: str
    reference_image: bytes
    def __init__(self, request_id: _Optional[str] = ..., condition: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., prompt_text: _Optional[str] = ..., reference_image: _Optional[bytes] = ...) -> None: ...

class ImageGenProgress(_message.Message):
    __slots__ = ("step", "total_steps")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ...) -> None: ...

class ImageGenImage(_message.Message):
    __slots__ = ("png", "width", "height", "seed", "generated_width", "generated_height", "steps")
    PNG_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_WIDTH_FIELD_NUMBER: _ClassVar[int]
    GENERATED_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    png: bytes
    width: int
    height: int
    seed: int
    generated_width: int
    generated_height: int
    steps: int
    def __init__(self, png: _Optional[bytes] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., seed: _Optional[int] = ..., generated_width: _Optional[int] = ..., generated_height: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class ImageGenEvent(_message.Message):
    __slots__ = ("progress", "image")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    progress: ImageGenProgress
    image: ImageGenImage
    def __init__(self, progress: _Optional[_Union[ImageGenProgress, _Mapping]] = ..., image: _Optional[_Union[ImageGenImage, _Mapping]] = ...) -> None: ...
