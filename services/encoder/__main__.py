"""`python -m omnistage.services.encoder --config F --service NAME`: the vision + audio encoder stage."""

from __future__ import annotations

import asyncio
import sys

import torch
from omnistage.common.runtime.boot import Boot, StageStartup, run_stage
from omnistage.common.transport import TransportContext, TransportOptions
from omnistage.services.encoder import startup
from omnistage.services.encoder.items import ItemLimits
from omnistage.services.encoder.models.loader import load_encoders
from omnistage.services.encoder.request_flow import EncoderEngine
from omnistage.services.encoder.server import EncoderServicer
from omnistage.v1 import control_pb2, encoder_pb2_grpc


class EncoderStartup(StageStartup):
    warm_up_detail = "one image, video and audio clip through the request path"

    def __init__(self, boot: Boot) -> None:
        super().__init__(boot)
        # The CUDA IPC pool is made with cudaMalloc, beside torch's allocator (0 off CUDA, or where
        # CUDA IPC turns out unavailable: the embeddings then go through shm).
        self.cuda_pool_bytes = boot.svc.encoder.transport_pool_bytes if boot.on_cuda else 0

    def outside_allocator_bytes(self) -> int:
        return self.cuda_pool_bytes

    def load(self) -> None:
        b = self.boot
        self.models = load_encoders(
            b.checkpoint, dtype=b.dtype, device=b.device, progress=b.progress.shards, dummy=b.dummy_weights
        )

    def stress(self) -> None:
        b = self.boot
        self.limits = ItemLimits.of(b.svc.encoder, self.models.config)
        self.profile = startup.profile(
            self.models, b.mem, self.limits, b.allocator_budget, b.progress.in_phase, b.full_warmup
        )

    async def warm_up(self) -> None:
        b, ecfg = self.boot, self.boot.svc.encoder
        transport = TransportContext(
            TransportOptions(
                shm_threshold_bytes=ecfg.inline_max_bytes,
                shm_pool_bytes=ecfg.transport_pool_bytes,
                cuda_pool_bytes=ecfg.transport_pool_bytes,
                lease_ttl_s=ecfg.lease_ttl_s,
            )
        )
        if self.cuda_pool_bytes and transport.cuda_pool(torch.device(b.device).index) is None:
            self.cuda_pool_bytes = 0  # CUDA IPC unavailable here: embeddings go through shm
        self.engine = EncoderEngine(
            self.models,
            ecfg,
            transport,
            self.profile.caps,
            service=b.svc.name,
            on_failure=lambda exc: b.runtime.fail(str(exc)),
        )
        self.engine.start(asyncio.get_running_loop())
        b.runtime.add_shutdown_hook(
            transport.close
        )  # hooks run last-added first: the engine stops, then the pool
        b.runtime.add_shutdown_hook(self.engine.stop)
        await startup.warm_up(self.engine)

    def serve(self) -> None:
        svc, prof, runtime = self.boot.svc, self.profile, self.boot.runtime
        runtime.add_servicer(
            encoder_pb2_grpc.add_EncoderServicer_to_server,
            EncoderServicer(self.engine),
            "omnistage.v1.Encoder",
        )
        runtime.set_limits_provider(
            lambda: control_pb2.Limits(
                max_message_bytes=svc.max_message_bytes,
                max_vision_batch_items=prof.vision.max_batch,
                max_audio_batch_items=prof.audio.max_batch,
                max_items_per_request=svc.encoder.max_items_per_request,
            )
        )
        self.engine.export_lease_gauges()
        self.engine.export_queue_time()

    def memory_report(self) -> control_pb2.MemoryReport:
        return self.profile.memory_report(self.boot.mem, self.models.weights_bytes, self.cuda_pool_bytes)


def main() -> None:
    run_stage(sys.argv[1:], "encoder", EncoderStartup)


if __name__ == "__main__":
    main()
