"""Prometheus gauges of a service's device memory, fed from the MemoryReport that Describe returns."""

from __future__ import annotations

import os

from omnistage.common import metrics
from omnistage.v1 import control_pb2
from prometheus_client import Gauge

# MemoryReport field → `kind` label of omnistage_memory_bytes.
KINDS: dict[str, str] = {
    "weights": "weights_bytes",
    "kv_cache": "kv_cache_bytes",
    "activation_peak": "activation_peak_bytes",
    "graph_pool": "graph_pool_bytes",
    "transport_pool": "transport_pool_bytes",
    "total": "total_bytes",
}


def memory_gauge() -> Gauge:
    return metrics.gauge(
        "memory_bytes",
        "Device memory a service rank holds, by kind (total is everything it holds; do not sum kinds)",
        ("rank", "device", "kind"),
    )


def memory_budget_gauge() -> Gauge:
    return metrics.gauge(
        "memory_budget_bytes", "Device-memory budget of a service rank; 0 when none", ("rank", "device")
    )


def export_memory(service: str, rank: int, report: control_pb2.MemoryReport) -> None:
    """Set the memory gauges of one rank from its MemoryReport (call after profiling and on changes)."""
    g = memory_gauge()
    for kind, fieldname in KINDS.items():
        g.labels(service, str(rank), report.device, kind).set(getattr(report, fieldname))
    memory_budget_gauge().labels(service, str(rank), report.device).set(report.budget_bytes)


def _resident_bytes() -> int:
    """This process's resident set (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def export_host_memory(service: str, rank: int = 0) -> None:
    """A service that holds no device (the gateway): its host memory as device `cpu`, kind `total`,
    read at scrape time; no budget (0). The memory ledger then lists every service."""
    memory_gauge().labels(service, str(rank), "cpu", "total").set_function(_resident_bytes)
    memory_budget_gauge().labels(service, str(rank), "cpu").set(0)
