"""`python -m omnistage.services.encoder --config F --service NAME`: the vision + audio encoder stage.

Start-up phases: loading_weights (per shard) → profiling_memory (stress-and-cap per modality) →
warming_up (one real image, video and audio clip through the request path) → serving
`omnistage.v1.Encoder`. CPU or one GPU (`gpus[0]`).
"""

from __future__ import annotations

import asyncio
import sys

import torch
from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.memory.device import device_memory_for
from omnistage.common.memory.report import export_memory
from omnistage.common.runtime.blocking import in_daemon_thread
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_main import run_service
from omnistage.common.transport import TransportContext, TransportOptions
from omnistage.services.encoder import startup
from omnistage.services.encoder.engine import EncoderEngine
from omnistage.services.encoder.items import ItemLimits
from omnistage.services.encoder.models.loader import load_encoders
from omnistage.services.encoder.server import EncoderServicer
from omnistage.v1 import control_pb2, encoder_pb2_grpc


def _device(svc: ServiceConfig) -> str:
    return "cpu" if svc.device == "cpu" else f"cuda:{(svc.gpus or (0,))[0]}"


async def build(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> None:
    device = _device(svc)
    dtype = getattr(torch, svc.dtype)
    mem = device_memory_for(device, svc.memory.simulated_capacity_bytes or None)
    pool_bytes = svc.encoder.transport_pool_bytes
    cuda_pool_bytes = pool_bytes if device.startswith("cuda") else 0  # made with cudaMalloc, outside torch
    budget = svc.memory.budget_of(mem.total())
    allocator_budget = max(budget - cuda_pool_bytes, 1) if budget else 0
    if allocator_budget and hasattr(mem, "set_limit"):
        mem.set_limit(allocator_budget)
    reporter = runtime.reporter

    def report(phase: str, detail: str) -> None:
        if reporter.phase != phase:
            reporter.enter(phase, detail=detail)
        else:
            reporter.heartbeat(detail)

    def progress(done: int, total: int) -> None:
        reporter.progress(done, total=total, detail=f"{done}/{total} shards")

    def load_and_profile():
        with mem.meter():
            models = load_encoders(cfg.model.checkpoint, dtype=dtype, device=device, progress=progress,
                                   dummy=cfg.model.load_format == "dummy")
            reporter.enter("profiling_memory", unit="attempts")
            limits = ItemLimits.of(svc.encoder, models.config)
            return models, limits, startup.profile(models, mem, limits, allocator_budget, report)

    reporter.enter("loading_weights", unit="shards")
    models, limits, prof = await in_daemon_thread(load_and_profile, "encoder-startup")

    reporter.enter("warming_up", detail="one image, video and audio clip through the request path")
    transport = TransportContext(
        TransportOptions(
            shm_threshold_bytes=svc.encoder.inline_max_bytes,
            shm_pool_bytes=pool_bytes,
            cuda_pool_bytes=pool_bytes,
            lease_ttl_s=svc.encoder.lease_ttl_s,
        )
    )
    if cuda_pool_bytes and transport.cuda_pool(torch.device(device).index) is None:
        cuda_pool_bytes = 0  # CUDA IPC unavailable here: embeddings go through shm
    engine = EncoderEngine(models, svc.encoder, transport, prof.caps, service=svc.name,
                           on_failure=lambda exc: runtime.fail(str(exc)))
    engine.start(asyncio.get_running_loop())
    runtime.add_shutdown_hook(transport.close)  # hooks run last-added first: the engine stops, then the pool goes
    runtime.add_shutdown_hook(engine.stop)
    await startup.warm_up(engine)

    runtime.add_servicer(encoder_pb2_grpc.add_EncoderServicer_to_server, EncoderServicer(engine), "omnistage.v1.Encoder")
    runtime.set_limits_provider(
        lambda: control_pb2.Limits(
            max_message_bytes=svc.max_message_bytes,
            max_vision_batch_items=prof.vision.max_batch,
            max_audio_batch_items=prof.audio.max_batch,
            max_items_per_request=svc.encoder.max_items_per_request,
        )
    )
    engine.export_lease_gauges()
    engine.export_queue_time()

    def memory() -> list[control_pb2.MemoryReport]:
        report = prof.memory_report(mem, models.weights_bytes, cuda_pool_bytes)
        report.budget_bytes = budget
        return [report]

    runtime.set_memory_provider(memory)
    export_memory(svc.name, rank, memory()[0])
    runtime.set_serving()


def main() -> None:
    run_service(sys.argv[1:], "encoder", build)


if __name__ == "__main__":
    main()
