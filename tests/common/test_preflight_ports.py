"""The ports `omnistage serve` checks before it starts anything include the gateway's HTTP front."""

from __future__ import annotations

import socket

from omnistage.common.config import config_from_dict
from omnistage.common.preflight import planned_ports, port_problems


def test_the_http_front_port_is_checked_before_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = config_from_dict(
            {"services": {"gateway": {"kind": "gateway", "port": 1, "gateway": {"http_port": port}}}}
        )
        assert ("services.gateway.gateway.http_port", "127.0.0.1", port) in planned_ports(cfg)
        assert any(f"services.gateway.gateway.http_port {port} is in use" in p for p in port_problems(cfg))
