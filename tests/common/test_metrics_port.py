"""The /metrics port answers /metrics only: every other path is 404 (a mistyped scrape path shows)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from omnistage.common import metrics


@pytest.fixture
def port():
    server = metrics.start_metrics_server(0)
    try:
        yield server.port
    finally:
        server.close()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_metrics_is_served(port):
    metrics.counter("metrics_port_probe", "a probe of the metrics port test", ()).labels("probe").inc()
    status, body = _get(port, "/metrics")
    assert status == 200 and 'omnistage_metrics_port_probe_total{service="probe"} 1.0' in body
    status, body = _get(port, "/metrics?name[]=omnistage_metrics_port_probe_total")
    assert status == 200 and "omnistage_metrics_port_probe_total" in body


@pytest.mark.parametrize(
    "path", ["/", "/metric", "/metrics/", "/metricsx", "/favicon.ico", "/v1/chat/completions"]
)
def test_every_other_path_is_404(port, path):
    status, body = _get(port, path)
    assert status == 404
    assert "serves /metrics only" in body
