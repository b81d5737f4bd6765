"""Tensor transport between stages: TensorRef encode/decode over inline bytes, POSIX shm or CUDA IPC.

The names below load their module on first use (PEP 562). Only encode/decode and the dtype table
(`tensor_ref`, `dtypes`) import torch: `transport.host` (segments, liveness, the stale-segment sweep) and
`TransportContext` (pools, mappings, lease release) do not, so the launcher, the CLI and the gateway,
which use only those, do not pay the seconds of CPU that importing torch costs each process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnistage.common.transport.context import TransportContext, TransportOptions
    from omnistage.common.transport.dtypes import SUPPORTED_DTYPES, from_proto_dtype, to_proto_dtype
    from omnistage.common.transport.host import TransportError, host_id, sweep_stale_segments
    from omnistage.common.transport.tensor_ref import decode, encode

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
    "TransportContext": "context",
    "TransportOptions": "context",
    "decode": "tensor_ref",
    "encode": "tensor_ref",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
