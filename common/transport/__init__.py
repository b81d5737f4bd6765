"""Tensor transport between stages: TensorRef encode/decode over inline bytes, POSIX shm or CUDA IPC.

The names below load their module on first use (PEP 562): `transport.host` (segments, liveness, the
stale-segment sweep) needs no torch, so the launcher and the CLI, which use only it, do not pay the
seconds of CPU that importing torch costs each process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
_MODULE_OF = {
    "SUPPORTED_DTYPES": "dtypes",
    "from_proto_dtype": "dtypes",
    "to_proto_dtype": "dtypes",
    "TransportError": "host",
    "host_id": "host",
    "sweep_stale_segments": "host",
    "TransportContext": "tensor_ref",
    "TransportOptions": "tensor_ref",
    "decode": "tensor_ref",
    "encode": "tensor_ref",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
