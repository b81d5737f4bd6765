"""Start-up stress-and-cap of the denoising batch on a simulated device: the cap is the largest batch of
requests (largest bucket, guidance on; the e2e start-up runs it with the reference frame) that fits;
the peak stays reserved."""

from __future__ import annotations

import pytest
import torch
from omnistage.common.config import ImageGenConfig
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.common.memory.stress import StressError
from omnistage.services.imagegen import startup
from omnistage.services.imagegen.models.loader import load_imagegen
from omnistage.services.imagegen.pipeline import ImagePipeline

CFG = ImageGenConfig(highres=512, default_side_px=512, stress_batch_sizes=(2, 1), allow_edits=False)


def _profile(tiny_ckpt, capacity: int):
    mem = SimulatedDeviceMemory(capacity)
    with mem.meter():
        models = load_imagegen(tiny_ckpt, dtype=torch.float32, device="cpu")
        pipeline = ImagePipeline(models, "cpu")
        details: list[str] = []
        prof = startup.profile(pipeline, CFG, mem, 0, lambda phase, detail: details.append(detail))
    return mem, models, prof, details


def test_caps_at_the_largest_batch_that_fits(tiny_ckpt):
    mem, models, prof, details = _profile(tiny_ckpt, 8 << 30)
    assert prof.cap == 2 and prof.bucket == (1024, 256)  # the 512 table's largest (tied) bucket
    assert details == ["2 requests at 256x1024, guidance on"]
    assert mem.reserved() == prof.result.peak_reserved  # kept reserved, no empty_cache
    report = prof.memory_report(mem, models.weights_bytes)
    assert report.activation_peak_bytes > 0 and report.weights_bytes == models.weights_bytes


def test_a_device_too_small_fails_naming_the_knobs(tiny_ckpt):
    mem = SimulatedDeviceMemory(64 << 20)
    with mem.meter():
        pipeline = ImagePipeline(load_imagegen(tiny_ckpt, dtype=torch.float32, device="cpu"), "cpu")
        mem.set_limit(mem.reserved() + (2 << 20))  # 2 MiB above the weights: no request fits
        with pytest.raises(StressError, match="imagegen denoising: no batch size fits") as err:
            startup.profile(pipeline, CFG, mem, 0, lambda phase, detail: None)
    assert "batch 2: out of memory" in str(err.value) and "batch 1: out of memory" in str(err.value)


def test_without_memory_to_prove_one_request_at_the_largest_bucket_runs_and_the_cap_is_the_largest(tiny_ckpt):
    mem = SimulatedDeviceMemory(8 << 30)
    details: list[str] = []
    with mem.meter():
        pipeline = ImagePipeline(load_imagegen(tiny_ckpt, dtype=torch.float32, device="cpu"), "cpu")
        prof = startup.profile(
            pipeline, CFG, mem, 0, lambda phase, detail: details.append(detail), full=False
        )
    assert prof.cap == 2 and details == ["1 requests at 256x1024, guidance on"]
    assert [a.batch for a in prof.result.attempts] == [1]
