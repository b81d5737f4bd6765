"""Tensor transport between stages: TensorRef encode/decode over inline bytes, POSIX shm or CUDA IPC."""

from omnistage.common.transport.dtypes import SUPPORTED_DTYPES, from_proto_dtype, to_proto_dtype
from omnistage.common.transport.host import TransportError, host_id, sweep_stale_segments
from omnistage.common.transport.tensor_ref import TransportContext, TransportOptions, decode, encode

__all__ = [
    "SUPPORTED_DTYPES",
    "TransportContext",
    "TransportError",
    "TransportOptions",
    "decode",
    "encode",
    "from_proto_dtype",
    "host_id",
    "sweep_stale_segments",
    "to_proto_dtype",
]
