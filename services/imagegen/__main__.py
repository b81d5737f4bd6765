"""`python -m omnistage.services.imagegen --config F --service NAME`: the image-generation stage.

Start-up phases (common/runtime/boot.py): loading_weights (mlp/, connector/, transformer/, vae/
shards) → profiling_memory (stress-and-cap of the denoising batch at the largest bucket; a plain CPU
runs its smallest batch once) → warming_up
(a text-to-image request and an edit through the request path) → serving `omnistage.v1.ImageGen`.
CPU or one GPU (`gpus[0]`). Loading and the stress run under inference_mode.
"""

from __future__ import annotations

import sys

from omnistage.common.runtime.boot import StageStartup, run_stage
from omnistage.common.transport import TransportContext
from omnistage.services.imagegen import startup
from omnistage.services.imagegen.models.loader import load_imagegen
from omnistage.services.imagegen.pipeline import ImagePipeline
from omnistage.services.imagegen.request_flow import ImageGenEngine
from omnistage.services.imagegen.server import ImageGenServicer
from omnistage.v1 import control_pb2, imagegen_pb2_grpc


class ImageGenStartup(StageStartup):
    warm_up_detail = "a text-to-image request and an edit through the request path"
    inference_mode = True

    def load(self) -> None:
        b = self.boot
        models = load_imagegen(
            b.checkpoint, dtype=b.dtype, device=b.device, progress=b.progress.shards, dummy=b.dummy_weights
        )
        self.pipeline = ImagePipeline(models, b.device, b.svc.imagegen.first_block_cache)

    def stress(self) -> None:
        b = self.boot
        self.profile = startup.profile(
            self.pipeline, b.svc.imagegen, b.mem, b.allocator_budget, b.progress.in_phase, b.full_warmup
        )

    async def warm_up(self) -> None:
        svc, runtime = self.boot.svc, self.boot.runtime
        transport = (
            TransportContext()
        )  # consumer only: the conditioning arrives as shm / CUDA IPC / inline refs
        self.engine = ImageGenEngine(
            self.pipeline,
            svc.imagegen,
            transport,
            self.profile.cap,
            service=svc.name,
            on_failure=lambda exc: runtime.fail(str(exc)),
        )
        self.engine.start()
        runtime.add_shutdown_hook(
            transport.close
        )  # hooks run last-added first: the engine stops, then transport
        runtime.add_shutdown_hook(self.engine.stop)
        await startup.warm_up(self.engine)

    def serve(self) -> None:
        svc, runtime, g, cap = self.boot.svc, self.boot.runtime, self.boot.svc.imagegen, self.profile.cap
        runtime.add_servicer(
            imagegen_pb2_grpc.add_ImageGenServicer_to_server,
            ImageGenServicer(self.engine),
            "omnistage.v1.ImageGen",
        )
        runtime.set_limits_provider(
            lambda: control_pb2.Limits(
                max_running_requests=cap,
                max_queued_requests=g.max_queued_requests,
                max_message_bytes=svc.max_message_bytes,
                min_image_side_px=g.min_side_px,
                max_image_side_px=g.max_side_px,
                max_denoising_steps=g.max_steps,
                max_image_batch=cap,
            )
        )
        runtime.set_load_provider(self.engine.load)
        self.engine.export_metrics()

    def memory_report(self) -> control_pb2.MemoryReport:
        return self.profile.memory_report(self.boot.mem, self.pipeline.models.weights_bytes)


def main() -> None:
    run_stage(sys.argv[1:], "imagegen", ImageGenStartup)


if __name__ == "__main__":
    main()
