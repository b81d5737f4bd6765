"""`python -m omnistage.services.imagegen --config F --service NAME`: the image-generation stage.

Start-up phases: loading_weights (mlp/, connector/, transformer/, vae/ shards) → profiling_memory
(stress-and-cap of the denoising batch at the largest bucket) → warming_up (a text-to-image request
and an edit through the request path) → serving `omnistage.v1.ImageGen`. CPU or one GPU (`gpus[0]`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import torch
from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.memory.device import device_memory_for
from omnistage.common.memory.report import export_memory
from omnistage.common.runtime.blocking import in_daemon_thread
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_main import run_service
from omnistage.common.transport import TransportContext
from omnistage.services.imagegen import startup
from omnistage.services.imagegen.engine import ImageGenEngine
from omnistage.services.imagegen.models.loader import load_imagegen
from omnistage.services.imagegen.pipeline import ImagePipeline
from omnistage.services.imagegen.server import ImageGenServicer
from omnistage.v1 import control_pb2, imagegen_pb2_grpc


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Blocking start-up work in a daemon thread (common.runtime.blocking), under inference_mode."""

    def run() -> Any:
        with torch.inference_mode():
            return fn()

    return in_daemon_thread(run, "imagegen-startup")


def _device(svc: ServiceConfig) -> str:
    return "cpu" if svc.device == "cpu" else f"cuda:{(svc.gpus or (0,))[0]}"


async def build(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> None:
    device = _device(svc)
    dtype = getattr(torch, svc.dtype)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    mem = device_memory_for(device, svc.memory.simulated_capacity_bytes or None)
    budget = svc.memory.budget_of(mem.total())
    if budget and hasattr(mem, "set_limit"):
        mem.set_limit(budget)
    reporter = runtime.reporter

    def report(phase: str, detail: str) -> None:
        if reporter.phase != phase:
            reporter.enter(phase, detail=detail)
        else:
            reporter.heartbeat(detail)

    def progress(done: int, total: int) -> None:
        reporter.progress(done, total=total, detail=f"{done}/{total} shards")

    def load_and_profile() -> tuple[ImagePipeline, startup.Profile]:
        with mem.meter():
            models = load_imagegen(cfg.model.checkpoint, dtype=dtype, device=device, progress=progress,
                                   dummy=cfg.model.load_format == "dummy")
            pipeline = ImagePipeline(models, device, svc.imagegen.first_block_cache)
            reporter.enter("profiling_memory", unit="attempts")
            return pipeline, startup.profile(pipeline, svc.imagegen, mem, budget, report)

    reporter.enter("loading_weights", unit="shards")
    pipeline, prof = await _in_daemon_thread(load_and_profile)

    reporter.enter("warming_up", detail="a text-to-image request and an edit through the request path")
    transport = TransportContext()  # consumer only: the conditioning arrives as shm / CUDA IPC / inline refs
    engine = ImageGenEngine(pipeline, svc.imagegen, transport, prof.cap, service=svc.name,
                            on_failure=lambda exc: runtime.fail(str(exc)))
    engine.start()
    runtime.add_shutdown_hook(transport.close)  # hooks run last-added first: the engine stops, then transport
    runtime.add_shutdown_hook(engine.stop)
    await startup.warm_up(engine)

    runtime.add_servicer(imagegen_pb2_grpc.add_ImageGenServicer_to_server, ImageGenServicer(engine),
                         "omnistage.v1.ImageGen")
    g = svc.imagegen
    runtime.set_limits_provider(
        lambda: control_pb2.Limits(
            max_running_requests=prof.cap,
            max_queued_requests=g.max_queued_requests,
            max_message_bytes=svc.max_message_bytes,
            min_image_side_px=g.min_side_px,
            max_image_side_px=g.max_side_px,
            max_denoising_steps=g.max_steps,
            max_image_batch=prof.cap,
        )
    )
    runtime.set_load_provider(engine.load)
    engine.export_metrics()

    def memory() -> list[control_pb2.MemoryReport]:
        return [prof.memory_report(mem, pipeline.models.weights_bytes)]

    runtime.set_memory_provider(memory)
    export_memory(svc.name, rank, memory()[0])
    runtime.set_serving()


def main() -> None:
    run_service(sys.argv[1:], "imagegen", build)


if __name__ == "__main__":
    main()
