"""Routes of the HTTP front that call no model: `/version` and `/metrics` (as vLLM serves them on its
API port, so one base URL gives a client, a probe and a scraper what they need)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from importlib import metadata

import prometheus_client
from omnistage.common.metrics import REGISTRY
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def package_version() -> str:
    """The installed omnistage's version ("unknown" when run from a tree that was never installed)."""
    try:
        return metadata.version("omnistage")
    except metadata.PackageNotFoundError:
        return "unknown"


class ExtraRoutes:
    """`authorize(request)` raises the front's 401 when the API key is wrong."""

    def __init__(self, authorize: Callable[[Request], None], registry=REGISTRY) -> None:
        self.authorize = authorize
        self.registry = registry
        self.version = package_version()

    def routes(self) -> list[Route]:
        return [
            Route("/version", self.version_route, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
        ]

    async def version_route(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"version": self.version})

    async def metrics_route(self, request: Request) -> Response:
        self.authorize(request)
        # Collecting every series is synchronous work that grows with the label sets: off the event loop.
        body = await asyncio.to_thread(prometheus_client.generate_latest, self.registry)
        return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)
