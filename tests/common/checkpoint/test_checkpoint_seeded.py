"""The tiny checkpoints' random tensors: one seed gives the same tensors, linears at their scale."""

from __future__ import annotations

import torch
from omnistage.common.checkpoint.seeded import SeededInit


def make(seed: int, **kw) -> dict[str, torch.Tensor]:
    init, t = SeededInit(seed, **kw), {}
    init.linear(t, "proj", 256, 128)
    init.layernorm(t, "norm", 64)
    init.linear(t, "head", 8, 128, bias=False, std=0.5)
    return t


def test_a_seed_gives_the_same_tensors_and_another_seed_others():
    a, b, c = make(0), make(0), make(1)
    assert a.keys() == {"proj.weight", "proj.bias", "norm.weight", "norm.bias", "head.weight"}
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["proj.weight"], c["proj.weight"])


def test_linears_take_the_stages_scale_unless_told_and_norms_sit_around_one():
    narrow, wide = make(0), make(0, linear_std=0.05)
    assert abs(narrow["proj.weight"].std().item() - 0.02) < 0.002
    assert abs(wide["proj.weight"].std().item() - 0.05) < 0.005
    assert abs(wide["head.weight"].std().item() - 0.5) < 0.1  # an explicit std wins
    assert abs(narrow["norm.weight"].mean().item() - 1.0) < 0.05
