"""Server reflection under both names clients use: `grpc.reflection.v1` (grpcurl, Postman, grpc-node
today) and `grpc.reflection.v1alpha` (older clients). grpcio-reflection ships only v1alpha for
Python; the two are wire-identical, so one implementation answers both, and our mirror of the v1
proto (omnistage/v1/grpc_reflection_v1.proto) puts the v1 service into the descriptor pool."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from omnistage.common.runtime.handlers import collect
from omnistage.v1 import grpc_reflection_v1_pb2

V1ALPHA = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
V1 = grpc_reflection_v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
NAMES = (V1, V1ALPHA)


def reflection_handlers(service_names: Sequence[str]) -> dict[str, grpc.RpcMethodHandler]:
    """Handlers of both reflection services, listing `service_names` plus themselves."""
    servicer = reflection.aio.ReflectionServicer([*service_names, *NAMES])
    handlers = collect(reflection_pb2_grpc.add_ServerReflectionServicer_to_server, servicer)
    v1alpha = handlers[f"/{V1ALPHA}/ServerReflectionInfo"]
    handlers[f"/{V1}/ServerReflectionInfo"] = v1alpha  # same bytes on the wire, same answers
    return handlers
