"""The DiT's first-block cache (off by default): a full forward with the cache on is the exact forward and
fills every row's state; inputs whose first-layer residual did not move reuse the rest and give the same
output; a change above the threshold in any row recomputes all; through the pipeline, off (0) is the
exact generation and a huge threshold reuses every step after the first."""

from __future__ import annotations

import torch
from omnistage.services.imagegen.models.dit import FirstBlockCache
from omnistage.services.imagegen.pipeline import GenerationSpec, ImagePipeline

from tests.services.imagegen.test_pipeline import BUCKET, _hidden, _run


def _inputs(dit, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, dit.cfg.in_channels, 1, 8, 8, generator=g)
    cap = torch.randn(2, 7, dit.cfg.cap_feat_dim, generator=g)
    return x, torch.tensor([0.2, 0.6]), cap


def test_a_full_forward_is_exact_and_a_repeat_reuses_the_rest(tiny_models):
    dit = tiny_models.dit
    x, t, cap = _inputs(dit, 0)
    cache = [FirstBlockCache(), FirstBlockCache()]
    with torch.inference_mode():
        exact = dit(x, t, cap)
        first = dit(x, t, cap, cache, 0.05)
        assert all(c.first is not None and c.reused == 0 for c in cache)
        again = dit(x, t, cap, cache, 0.05)  # nothing moved: the rest is reused
        assert [c.reused for c in cache] == [1, 1]
        moved = dit(x, t.flip(0), cap, cache, 1e-6)  # both rows' time changed: recomputed, exact again
        assert [c.reused for c in cache] == [1, 1]
        want_moved = dit(x, t.flip(0), cap)
    torch.testing.assert_close(first, exact, atol=0, rtol=0)
    torch.testing.assert_close(again, exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moved, want_moved, atol=0, rtol=0)


def test_one_row_that_moved_makes_every_row_recompute(tiny_models):
    dit = tiny_models.dit
    x, t, cap = _inputs(dit, 1)
    cache = [FirstBlockCache(), FirstBlockCache()]
    with torch.inference_mode():
        dit(x, t, cap, cache, 0.01)
        t2 = t.clone()
        t2[1] = 0.95
        dit(x, t2, cap, cache, 0.01)
    assert [c.reused for c in cache] == [0, 0]


def test_the_pipeline_is_exact_when_off_and_reuses_with_a_huge_threshold(tiny_models, pipeline):
    spec = GenerationSpec(_hidden(1), BUCKET, 5, 2.0, 1234)
    exact_state, exact = _run(pipeline, spec)
    off_state, off = _run(ImagePipeline(tiny_models, "cpu", first_block_cache=0.0), spec)
    assert torch.equal(off, exact) and all(c.first is None for c in off_state.block_cache)
    on_state, _ = _run(ImagePipeline(tiny_models, "cpu", first_block_cache=1e9), spec)
    assert on_state.forwards == exact_state.forwards == 4
    assert [c.reused for c in on_state.block_cache] == [3, 3]  # every forward after the first
