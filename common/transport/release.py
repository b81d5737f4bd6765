"""Ending a lease that its consumer will never take, where a failed release is harmless.

The gateway ends the leases of refs that will not reach the next stage, the thinker those of items it
did not copy. A second release is a no-op, and a producer that is gone took its leases with it, so a
failure is logged, never raised: the request that dropped the ref is over either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnistage.common.log import get_logger
from omnistage.common.transport.host import TransportError

if TYPE_CHECKING:
    from omnistage.common.transport.context import TransportContext
    from omnistage.v1 import tensor_pb2

log = get_logger(__name__)


def release_quietly(transport: TransportContext, ref: tensor_pb2.TensorRef, what: str) -> None:
    """Release `ref`'s shm / CUDA IPC lease; on failure log "`what` not released" and go on."""
    try:
        transport.release(ref)
    except (TransportError, OSError, ValueError) as exc:
        log.warning("%s not released: %s", what, exc)
