"""ImageGen start-up work: stress-and-cap the denoising batch, warm up through the request path."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
from omnistage.common.config import ImageGenConfig
from omnistage.common.memory.device import DeviceMemory
from omnistage.common.memory.stress import StressAndCap, StressResult
from omnistage.common.runtime.progress import Report
from omnistage.common.transport import encode
from omnistage.services.imagegen import images
from omnistage.services.imagegen.pipeline import GenerationSpec, ImagePipeline
from omnistage.services.imagegen.request_flow import ImageGenEngine, ImageResult
from omnistage.v1 import control_pb2, imagegen_pb2
from PIL import Image

STRESS_STEPS = 2


@dataclass
class Profile:
    """What the stress proved: the concurrent-request cap and the memory it needs."""

    result: StressResult
    bucket: tuple[int, int]

    @property
    def cap(self) -> int:
        return self.result.max_batch

    def memory_report(self, mem: DeviceMemory, weights_bytes: int) -> control_pb2.MemoryReport:
        r = self.result
        return control_pb2.MemoryReport(
            device=mem.device_name,
            budget_bytes=r.budget_bytes,
            weights_bytes=weights_bytes,
            activation_peak_bytes=r.activation_peak_bytes,
            total_bytes=mem.reserved(),
        )


def stress_spec(
    pipeline: ImagePipeline, cfg: ImageGenConfig, bucket: tuple[int, int], seed: int
) -> GenerationSpec:
    mc = pipeline.models.config
    condition = torch.randn(
        mc.mlp.num_queries, mc.thinker_hidden, generator=torch.Generator().manual_seed(seed)
    )
    reference = None
    if cfg.allow_edits:
        reference = np.random.default_rng(seed).integers(0, 256, (*bucket, 3), dtype=np.uint8)
    return GenerationSpec(
        condition, bucket, STRESS_STEPS, max(cfg.default_guidance_scale, 2.0), seed, reference
    )


def profile(
    pipeline: ImagePipeline,
    cfg: ImageGenConfig,
    mem: DeviceMemory,
    budget: int,
    report: Report,
    full: bool = True,
) -> Profile:
    """Stress-and-cap on `mem` within `budget` bytes (0: none); call inside `mem.meter()` after loading.

    Not `full` (a plain CPU: no kernels to build, no device memory to prove; `Boot.full_warmup`): one
    request at the largest bucket runs once (`StressAndCap.prove`: the transformer, guidance and the
    VAE decode at the largest shapes) and the largest batch is the cap, all the full stress can
    conclude there; the warm-up then proves the request path at the smallest side."""
    bucket = images.largest_bucket(cfg.highres)

    def run(batch: int) -> object:
        report(
            "profiling_memory",
            f"{batch} requests at {bucket[1]}x{bucket[0]}"
            f"{' with a reference frame' if cfg.allow_edits else ''}, guidance on",
        )
        states = [pipeline.prepare(stress_spec(pipeline, cfg, bucket, seed)) for seed in range(batch)]
        pipeline.step(states)
        return pipeline.decode(states[0])

    stress = StressAndCap("imagegen denoising", mem, run, cfg.stress_batch_sizes, budget_bytes=budget)
    return Profile(stress.run() if full else stress.prove(), bucket)


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


async def warm_up(engine: ImageGenEngine) -> None:
    """A text-to-image request and (with edits) an edit through the engine; the PNGs must decode."""
    mc = engine.pipeline.models.config
    condition = torch.randn(mc.mlp.num_queries, mc.thinker_hidden, generator=torch.Generator().manual_seed(0))
    side = engine.cfg.min_side_px
    requests = [
        imagegen_pb2.ImageGenRequest(
            condition=encode(condition, force="inline"), width=side, height=side, steps=2, seed=0
        )
    ]
    if engine.cfg.allow_edits:
        requests.append(
            imagegen_pb2.ImageGenRequest(
                condition=encode(condition, force="inline"),
                width=side,
                height=side,
                steps=1,
                seed=1,
                reference_image=png_bytes(48, 32),
            )
        )
    for req in requests:
        parsed = await engine.parse(req)
        results = [ev async for ev in engine.generate(parsed, timeout_s=600.0) if isinstance(ev, ImageResult)]
        img = Image.open(io.BytesIO(results[-1].png))
        if img.size != (side, side):
            raise RuntimeError(f"warm-up image is {img.size}, expected {(side, side)}")
