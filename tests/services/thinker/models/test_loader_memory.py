"""Loading bf16 weights never holds an fp32 copy and peaks at the weights plus one checkpoint tensor.

Metered by the simulated device accountant (every tensor made while loading counts) and a recorder
of every tensor an op returns."""

from __future__ import annotations

import torch
from omnistage.common.checkpoint.shards import shard_files
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.thinker.models.loader import load_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class ShapeRecorder(TorchDispatchMode):
    """(shape, dtype) of every real (non-meta) tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tensors += [
            (tuple(t.shape), t.dtype)
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and not t.is_meta
        ]
        return out


def test_bf16_load_has_no_fp32_peak(tiny_ckpt):
    mem = SimulatedDeviceMemory(1 << 34)
    rec = ShapeRecorder()
    with mem.meter(), rec:
        model = load_model(tiny_ckpt, dtype=torch.bfloat16, device="cpu")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    params = {tuple(p.shape) for p in model.parameters()}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    largest_shard = max(f.stat().st_size for f in shard_files(tiny_ckpt))
    assert weights <= mem.peak_allocated() <= weights * 1.05 + largest_shard
    fp32_copies = [s for s, dt in rec.tensors if dt == torch.float32 and s in params]
    assert not fp32_copies, f"fp32 copies of bf16 parameters materialised: {fp32_copies[:5]}"
    assert any(dt == torch.bfloat16 and s in params for s, dt in rec.tensors)  # the recorder saw the params


def test_the_check_catches_a_naive_fp32_build_then_cast(tiny_ckpt):
    """Control: building in the default dtype and casting (the outage) trips both checks above."""
    from omnistage.services.thinker.models.bailing_moe_v2 import BailingMoeV2ForCausalLM
    from omnistage.services.thinker.models.config import ThinkerConfig

    mem = SimulatedDeviceMemory(1 << 34)
    rec = ShapeRecorder()
    with mem.meter(), rec:
        model = BailingMoeV2ForCausalLM(ThinkerConfig.from_checkpoint(tiny_ckpt)).to(torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    params = {tuple(p.shape) for p in model.parameters()}
    assert any(dt == torch.float32 and s in params for s, dt in rec.tensors)
    assert mem.peak_allocated() > weights * 1.05 + max(f.stat().st_size for f in shard_files(tiny_ckpt))
