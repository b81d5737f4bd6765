"""The one table between torch dtypes and `omnistage.v1.DType`; every other module goes through it."""

from __future__ import annotations

import torch
from omnistage.v1 import tensor_pb2

_TO_PROTO: dict[torch.dtype, int] = {
    torch.bool: tensor_pb2.DTYPE_BOOL,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.int8: tensor_pb2.DTYPE_INT8,
    torch.int16: tensor_pb2.DTYPE_INT16,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.float64: tensor_pb2.DTYPE_FLOAT64,
}
_FROM_PROTO: dict[int, torch.dtype] = {v: k for k, v in _TO_PROTO.items()}

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_TO_PROTO)


def to_proto_dtype(dtype: torch.dtype) -> int:
    """torch dtype -> DType enum value; TypeError names the dtype and what is supported."""
    try:
        return _TO_PROTO[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"tensor transport does not support dtype {dtype} (supported: {names})") from None


def from_proto_dtype(value: int) -> torch.dtype:
    """DType enum value -> torch dtype; TypeError for DTYPE_UNSPECIFIED and unknown values."""
    try:
        return _FROM_PROTO[value]
    except KeyError:
        name = tensor_pb2.DType.Name(value) if value in tensor_pb2.DType.values() else str(value)
        raise TypeError(f"TensorRef has no usable dtype: {name}") from None
