"""Prometheus metrics: shared names (`omnistage_*`, always with a `service` label) and the /metrics port.

Services create their own metrics through `counter` / `gauge` / `histogram`, which are idempotent
(asking twice for one name returns the same metric), so modules can declare what they use locally.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

REGISTRY = prometheus_client.REGISTRY
PREFIX = "omnistage_"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Per-token and per-copy times: inter-token latency, tensor transfers (10 µs to 10 s).
FINE_BUCKETS_S = (
    1e-5,
    5e-5,
    1e-4,
    5e-4,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)

_lock = threading.Lock()
_metrics: dict[str, tuple[type, tuple[str, ...], Any]] = {}
# The `service` label of metrics a process records without knowing its service (the tensor transport):
# the deploy file's service name, set by the service runtime at start; "" (no label value) before.
_process_service = ""
_on_named: list[Callable[[str], None]] = []


def set_process_service(name: str) -> None:
    """Name the service this process runs (ServiceRuntime does it): the `service` label of shared code.
    Runs the `when_service_named` callbacks (they export their series at 0 under that name)."""
    global _process_service
    with _lock:
        _process_service = name
        callbacks = list(_on_named)
    for fn in callbacks:
        fn(name)


def process_service() -> str:
    return _process_service


def when_service_named(fn: Callable[[str], None]) -> None:
    """Call `fn(service)` now if the process's service is named already, and at every naming."""
    with _lock:
        _on_named.append(fn)
        name = _process_service
    if name:
        fn(name)


def _full_name(name: str) -> str:
    return name if name.startswith(PREFIX) else PREFIX + name


def _get_or_create(cls: type, name: str, doc: str, labels: Sequence[str], **kwargs: Any) -> Any:
    full = _full_name(name)
    labelnames = ("service", *(label for label in labels if label != "service"))
    with _lock:
        if full in _metrics:
            have_cls, have_labels, metric = _metrics[full]
            if have_cls is not cls or have_labels != labelnames:
                raise ValueError(
                    f"metric {full} already exists as {have_cls.__name__}{list(have_labels)}, "
                    f"asked for {cls.__name__}{list(labelnames)}"
                )
            return metric
        metric = cls(full, doc, labelnames, registry=REGISTRY, **kwargs)
        _metrics[full] = (cls, labelnames, metric)
        return metric


def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    """`omnistage_<name>` counter with labels (service, *labels)."""
    return _get_or_create(Counter, name, doc, labels)


def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
    return _get_or_create(Gauge, name, doc, labels)


def histogram(
    name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS_S
) -> Histogram:
    return _get_or_create(Histogram, name, doc, labels, buckets=tuple(buckets))


def observe_many(child: Any, value: float, count: int) -> None:
    """Record `count` observations of `value` in one histogram child at once (an engine step's tokens
    that share one latency): one bucket update instead of `count` observe() calls."""
    if count <= 0:
        return
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None:  # another prometheus_client layout: the slow way
        for _ in range(count):
            child.observe(value)
        return
    total.inc(value * count)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(count)
            break


# Shared metrics of every service -------------------------------------------------------------


def phase_gauge() -> Gauge:
    return gauge(
        "phase", "1 for the current life-cycle phase of the process, 0 for the others", ("rank", "phase")
    )


def phase_progress_gauge() -> Gauge:
    return gauge("phase_progress", "Progress count inside the current phase (shards, graphs, ...)", ("rank",))


def rpc_requests() -> Counter:
    return counter("rpc_requests", "Stage RPCs finished, by method and gRPC status code", ("method", "code"))


def rpc_latency() -> Histogram:
    return histogram("rpc_latency_seconds", "Wall time of stage RPCs, by method", ("method",))


def rpc_in_flight() -> Gauge:
    return gauge("rpc_in_flight", "Stage RPCs running now", ())


def set_phase(service: str, rank: int, phase: str, phases: Sequence[str], done: int = 0) -> None:
    """Point the phase gauge at `phase` (others 0) and export its progress count."""
    g = phase_gauge()
    for p in phases:
        g.labels(service, str(rank), p).set(1.0 if p == phase else 0.0)
    phase_progress_gauge().labels(service, str(rank)).set(done)


# /metrics HTTP port --------------------------------------------------------------------------


@dataclass
class MetricsServer:
    """The running /metrics HTTP server; `close()` frees the port."""

    server: Any
    thread: threading.Thread
    port: int

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


METRICS_PATH = "/metrics"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not logged (one line every few seconds per scraper)."""


def metrics_only_app(registry: Any = REGISTRY) -> Callable[..., Iterable[bytes]]:
    """A WSGI app serving the registry on /metrics and 404 on every other path: the port answers what it
    is for, and a typo in a scrape config shows as an error, not as an empty-looking 200."""
    export = prometheus_client.make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"not found: this port serves {METRICS_PATH} only\n".encode()]
        return export(environ, start_response)

    return app


def start_metrics_server(port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve the registry on http://host:port/metrics, 404 elsewhere (port 0 picks a free one, for tests)."""

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    server = make_server(host, port, metrics_only_app(), Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(server, thread, server.server_address[1])
