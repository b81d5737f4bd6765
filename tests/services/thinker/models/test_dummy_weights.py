"""`load_format: dummy`: random weights in the real shapes and dtype from a config-only checkpoint,
made on the device without an fp32 copy, sane magnitudes, the same full weights at every TP size."""

from __future__ import annotations

import math

import pytest
import torch
from omnistage.common.checkpoint.config_only import write_config_checkpoint
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.thinker.models.bailing_moe_v2 import checkpoint_shapes
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.loader import load_model

from tests.services.thinker.models.test_loader_memory import ShapeRecorder


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    return write_config_checkpoint(tmp_path_factory.mktemp("config-only"), "tiny")


def test_dummy_bf16_weights_are_made_in_bf16_with_sane_magnitudes(config_only):
    mem = SimulatedDeviceMemory(1 << 34)
    rec = ShapeRecorder()
    with mem.meter(), rec:
        model = load_model(config_only, dtype=torch.bfloat16, device="cpu", load_format="dummy")
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    weights = sum(p.numel() * p.element_size() for p in params.values())
    largest = (
        max(math.prod(s) for s in checkpoint_shapes(ThinkerConfig.from_checkpoint(config_only)).values()) * 2
    )
    assert weights <= mem.peak_allocated() <= weights * 1.05 + largest  # one checkpoint tensor at a time
    shapes = {tuple(p.shape) for p in params.values()}
    assert not [s for s, dt in rec.tensors if dt == torch.float32 and s in shapes], (
        "fp32 copies of bf16 weights"
    )
    for name, p in params.items():
        if name.endswith("norm.weight"):
            assert bool((p == 1).all()), name
        elif name.endswith("expert_bias"):
            assert bool((p == 0).all()), name
        elif name.endswith("lm_head.weight") or name.endswith("word_embeddings.weight") or p.numel() > 4096:
            assert 0.015 < float(p.float().std()) < 0.025, name
    ids = torch.tensor([5, 6, 7, 8])
    hidden = model(ids, torch.arange(4))
    assert torch.isfinite(hidden).all() and torch.isfinite(model.compute_logits(hidden[-1:])).all()


def test_every_tp_size_slices_the_same_full_weights(config_only):
    full = load_model(config_only, dtype=torch.float32, device="cpu", load_format="dummy")
    halves = [
        load_model(config_only, dtype=torch.float32, device="cpu", load_format="dummy", tp_rank=r, tp_size=2)
        for r in (0, 1)
    ]
    head = full.lm_head.weight
    rows = halves[0].lm_head.rows
    assert torch.equal(halves[0].lm_head.weight, head[:rows])
    assert torch.equal(halves[1].lm_head.weight[: head.shape[0] - rows], head[rows:])
    # A row-parallel layer splits its input dimension: the two halves side by side are the whole.
    dense = [h.model.layers[1].attention.dense.weight for h in halves]
    assert torch.equal(torch.cat(dense, dim=1), full.model.layers[1].attention.dense.weight)


def test_an_unknown_load_format_is_refused(config_only):
    with pytest.raises(ValueError, match="model.load_format"):
        load_model(config_only, dtype=torch.float32, device="cpu", load_format="pt")
