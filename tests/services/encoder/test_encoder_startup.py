"""Start-up stress-and-cap of the encoder on a simulated device: the cap is the largest batch that fits
at the largest configured item, the peak stays reserved, and the memory report says so."""

from __future__ import annotations

import dataclasses

import torch
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.encoder import startup
from omnistage.services.encoder.items import ItemLimits
from omnistage.services.encoder.models.loader import load_encoders

from tests.services.encoder.engine_helpers import SMALL

CFG = dataclasses.replace(SMALL, stress_batch_sizes=(4, 2, 1))


def _loaded(tiny_ckpt, capacity: int):
    mem = SimulatedDeviceMemory(capacity)
    with mem.meter():
        models = load_encoders(tiny_ckpt, dtype=torch.float32, device="cpu")
    return mem, models, ItemLimits.of(CFG, models.config)


def _profile(mem, models, limits):
    with mem.meter():
        return startup.profile(models, mem, limits, 0, lambda phase, detail: None)


def test_largest_vision_item_is_the_image_or_the_video_with_more_patches(tiny_encoders):
    limits = ItemLimits.of(CFG, tiny_encoders.config)
    assert startup.largest_vision_grid(CFG, limits) == (1, 16, 16)  # 256x256 image: 256 patches
    many_frames = dataclasses.replace(CFG, max_video_frames=64, video_total_pixels=64 * 64 * 64)
    # 64 frames of 2·262144/64 = 8192 px → 64x64 → 32 temporal patches x 4 x 4 = 512 patches > 256.
    assert startup.largest_vision_grid(many_frames, ItemLimits.of(many_frames, tiny_encoders.config)) == (
        32,
        4,
        4,
    )


def test_ample_memory_gives_the_largest_candidate_and_keeps_the_peak(tiny_ckpt):
    mem, models, limits = _loaded(tiny_ckpt, 8 << 30)
    prof = _profile(mem, models, limits)
    assert prof.caps == {"vision": 4, "audio": 4}
    assert [a.batch for a in prof.vision.attempts] == [4]
    assert mem.reserved() == max(prof.vision.peak_reserved, prof.audio.peak_reserved)  # no empty_cache
    report = prof.memory_report(mem, models.weights_bytes, 0)
    assert report.weights_bytes == models.weights_bytes and report.activation_peak_bytes > 0
    assert report.total_bytes == mem.reserved()


def test_a_small_device_caps_the_batch_below_the_configured_largest(tiny_ckpt):
    mem, models, limits = _loaded(tiny_ckpt, 8 << 30)
    prof = _profile(mem, models, limits)
    per_item = (prof.vision.peak_reserved - prof.vision.baseline_reserved) / 4
    capacity = int(prof.vision.baseline_reserved + 2.5 * per_item)  # room for about 2 items, not 4
    mem, models, limits = _loaded(tiny_ckpt, capacity)
    small = _profile(mem, models, limits)
    assert small.caps["vision"] == 2
    assert [a.batch for a in small.vision.attempts] == [4, 2]
    assert "out of memory" in small.vision.attempts[0].reason


def test_without_memory_to_prove_each_tower_runs_its_largest_item_once_and_keeps_the_largest_cap(tiny_ckpt):
    mem, models, limits = _loaded(tiny_ckpt, 8 << 30)
    details: list[str] = []
    with mem.meter():
        prof = startup.profile(
            models, mem, limits, 0, lambda phase, detail: details.append(detail), full=False
        )
    assert prof.caps == {"vision": 4, "audio": 4}
    assert [a.batch for a in prof.vision.attempts] == [1] == [a.batch for a in prof.audio.attempts]
    grid = startup.largest_vision_grid(CFG, limits)
    assert details == [f"vision batch 1 x grid {grid}", f"audio batch 1 x {limits.max_audio_seconds:g} s"]
    assert prof.memory_report(mem, models.weights_bytes, 0).activation_peak_bytes > 0
