"""The transport's Prometheus series: tensors, bytes and time by path and direction, fallbacks, expired
leases. Apart from encode/decode so that a process that only holds a `TransportContext` (the gateway)
exports them without importing torch."""

from __future__ import annotations

from omnistage.common import metrics

PATHS = ("inline", "shm", "cuda_ipc")
DIRECTIONS = ("encode", "decode")
FALLBACK_REASONS = ("pool_full", "too_large", "shm_unavailable", "cuda_ipc_unavailable")

# Labelled by the process's service (metrics.set_process_service) and path / direction / reason.
TENSORS = metrics.counter("transport_tensors", "Tensors moved, by path and direction", ("path", "direction"))
BYTES = metrics.counter("transport_bytes", "Tensor bytes moved, by path and direction", ("path", "direction"))
SECONDS = metrics.histogram(
    "transport_transfer_seconds",
    "Wall time of one tensor's encode (copy into the pool or into inline bytes) or decode (map and copy "
    "out), by path and direction",
    ("path", "direction"),
    buckets=metrics.FINE_BUCKETS_S,
)
FALLBACKS = metrics.counter(
    "transport_fallbacks",
    "Tensors that wanted shared memory but went another way (pool_full, too_large, shm_unavailable, "
    "cuda_ipc_unavailable)",
    ("reason",),
)
EXPIRED = metrics.counter("transport_leases_expired", "Leases reclaimed unreleased after their TTL")


def _init_metrics(service: str) -> None:
    """Export every path, direction and reason at 0 for the process's service (a series that appears
    only at its first count hides the first increase from rate())."""
    for path in PATHS:
        for direction in DIRECTIONS:
            TENSORS.labels(service, path, direction)
            BYTES.labels(service, path, direction)
    for reason in FALLBACK_REASONS:
        FALLBACKS.labels(service, reason)
    EXPIRED.labels(service)


metrics.when_service_named(_init_metrics)
