"""An in-process EncoderEngine on the tiny towers with small limits, for engine and runner tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from omnistage.common.config import EncoderConfig
from omnistage.common.transport import TransportContext, TransportOptions
from omnistage.services.encoder.request_flow import EncoderEngine

SMALL = EncoderConfig(
    image_max_pixels=256 * 256,
    max_input_image_pixels=2000 * 2000,
    video_min_pixels=32 * 32 * 4,
    video_total_pixels=16 * 64 * 64,
    max_video_frames=16,
    max_video_seconds=20.0,
    max_audio_seconds=3.0,
    max_items_per_request=4,
    queue_timeout_s=30.0,
)


def run_engine(
    models,
    body: Callable[[EncoderEngine], Awaitable[Any]],
    *,
    caps: dict[str, int] | None = None,
    cfg: EncoderConfig = SMALL,
    pool_bytes: int = 8 << 20,
) -> Any:
    """Start an engine on a fresh loop, run `body(engine)`, stop everything; returns body's result."""

    async def main() -> Any:
        transport = TransportContext(TransportOptions(shm_pool_bytes=pool_bytes, shm_threshold_bytes=1024))
        engine = EncoderEngine(models, cfg, transport, caps or {"vision": 4, "audio": 4}, service="enc-test")
        engine.start(asyncio.get_running_loop())
        try:
            return await body(engine)
        finally:
            engine.stop()
            transport.close()

    return asyncio.run(main())


def leases(engine: EncoderEngine) -> tuple[int, int]:
    """(active leases, used bytes) of the engine's shm pool after reclaiming released slices."""
    pool = engine.transport.shm_pool()
    pool.arena.reclaim()
    return pool.arena.active_leases, pool.arena.used_bytes
