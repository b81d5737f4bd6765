from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_BOOL: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
DTYPE_INT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType

class ShmRef(_message.Message):
    __slots__ = ("pool_name", "pool_byte_size", "offset", "byte_size", "lease_id", "lease_expiry_unix_ms")
    POOL_NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    pool_name: str
    pool_byte_size: int
    offset: int
    byte_size: int
    lease_id: int
    lease_expiry_unix_ms: int
    def __init__(self, pool_name: _Optional[str] = ..., pool_byte_size: _Optional[int] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_expiry_unix_ms: _Optional[int] = ...) -> None: ...

class CudaIpcRef(_message.Message):
    __slots__ = ("pool_id", "ipc_handle", "device_index", "pool_byte_size", "offset", "byte_size", "lease_id", "lease_expiry_unix_ms")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    ipc_handle: bytes
    device_index: int
    pool_byte_size: int
    offset: int
    byte_size: int
    lease_id: int
    lease_expiry_unix_ms: int
    def __init__(self, pool_id: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., device_index: _Optional[int] = ..., pool_byte_size: _Optional[int] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_expiry_unix_ms: _Optional[int] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("dtype", "shape", "host_id", "producer_pid", "inline_data", "shm", "cuda")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_PID_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    host_id: str
    producer_pid: int
    inline_data: bytes
    shm: ShmRef
    cuda: CudaIpcRef
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., host_id: _Optional[str] = ..., producer_pid: _Optional[int] = ..., inline_data: _Optional[bytes] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcRef, _Mapping]] = ...) -> None: ...
