"""Our vision tower against transformers' Qwen3-VL vision model on the tiny checkpoint's weights (fp32).

transformers' `Qwen3VLVisionModel` is the Qwen3-VL(-MoE) ViT Ming uses (ming.md §3.2); its parameter
names equal the checkpoint's `vision.*` names without the prefix, so the weights load one to one
(deepstack mergers included: they run there and are ignored, as in Ming). Its `pooler_output` is the
merger output, the input of Ming's `linear_proj`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers  # a dev dependency: the reference must be there, never skipped

# (t, h, w) patch grids: non-square, taller than the 8x8 position table, and two temporal slices.
CASES = {
    "non_square": [(1, 4, 6)],
    "two_images": [(1, 4, 6), (1, 6, 2)],
    "larger_than_table_and_video": [(1, 10, 12), (2, 4, 4)],
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def hf_vision(tiny_encoders, raw_tensors):
    c = tiny_encoders.config.vision
    hf_cfg = transformers.Qwen3VLVisionConfig(
        depth=c.depth,
        hidden_size=c.hidden_size,
        hidden_act=c.hidden_act,
        intermediate_size=c.intermediate_size,
        num_heads=c.num_heads,
        in_channels=c.in_channels,
        patch_size=c.patch_size,
        spatial_merge_size=c.spatial_merge_size,
        temporal_patch_size=c.temporal_patch_size,
        out_hidden_size=c.out_hidden_size,
        num_position_embeddings=c.num_position_embeddings,
        deepstack_visual_indexes=list(c.deepstack_visual_indexes),
    )
    hf_cfg._attn_implementation = "eager"
    model = transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel(hf_cfg).float().eval()
    state = {k.removeprefix("vision."): v for k, v in raw_tensors.items() if k.startswith("vision.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_vision_tower_matches_transformers(case, tiny_encoders, hf_vision):
    grids = CASES[case]
    n = sum(t * h * w for t, h, w in grids)
    patches = torch.randn(
        n, tiny_encoders.config.vision.patch_dim, generator=torch.Generator().manual_seed(1)
    )
    with torch.inference_mode():
        ours = tiny_encoders.vision.vision(patches, grids)
        ref = hf_vision(hidden_states=patches, grid_thw=torch.tensor(grids)).pooler_output
    assert ours.shape == ref.shape == (n // 4, tiny_encoders.config.vision.out_hidden_size)
    assert _rel(ours, ref) <= 1e-5


def test_projector_and_l2_norm_follow_the_merger(tiny_encoders, hf_vision, raw_tensors):
    grids = CASES["two_images"]
    n = sum(t * h * w for t, h, w in grids)
    patches = torch.randn(
        n, tiny_encoders.config.vision.patch_dim, generator=torch.Generator().manual_seed(2)
    )
    with torch.inference_mode():
        merged = hf_vision(hidden_states=patches, grid_thw=torch.tensor(grids)).pooler_output
        h = F.linear(merged, raw_tensors["linear_proj.0.weight"], raw_tensors["linear_proj.0.bias"])
        ref = F.normalize(
            F.linear(F.gelu(h), raw_tensors["linear_proj.2.weight"], raw_tensors["linear_proj.2.bias"]),
            dim=-1,
        )
        blocks = tiny_encoders.vision.encode_items([patches[:24], patches[24:]], grids)
    ours = torch.cat(blocks)
    assert [b.shape[0] for b in blocks] == [6, 3]
    assert _rel(ours, ref) <= 1e-5
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(ours)), atol=1e-6)


def test_an_item_encodes_the_same_alone_and_batched(tiny_encoders):
    grids = CASES["larger_than_table_and_video"]
    gen = torch.Generator().manual_seed(3)
    items = [
        torch.randn(t * h * w, tiny_encoders.config.vision.patch_dim, generator=gen) for t, h, w in grids
    ]
    alone = [tiny_encoders.vision.encode_items([p], [g])[0] for p, g in zip(items, grids, strict=True)]
    batched = tiny_encoders.vision.encode_items(items, grids)
    for a, b in zip(alone, batched, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_packed_layout_marks_each_temporal_slice_of_each_item():
    from omnistage.services.encoder.models.vision import PackedLayout

    layout = PackedLayout.of([(1, 4, 6), (2, 4, 4), (1, 2, 2)], torch.device("cpu"))
    assert layout.kind == "segments"  # "auto" off CUDA
    assert layout.cu_seqlens.tolist() == [0, 24, 40, 56, 60] and layout.cu_seqlens.dtype == torch.int32
    assert layout.lengths == (24, 16, 16, 4) and layout.max_len == 24
    assert sorted(len(r) for s in layout.segments for r in s.tolist()) == [4, 16, 16, 24]


@pytest.mark.parametrize("kind", ["mask", "flash"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_block_diagonal_reference_equals_the_segment_path(case, kind, tiny_encoders):
    """The varlen layout (cu_seqlens) that flash attention reads on CUDA, applied as a block-diagonal mask,
    gives the equal-length segment path's features: items packed together never see each other. A flash
    layout over fp32 tensors (no flash kernel) takes the segment path from its lengths."""
    grids = CASES[case] + [(1, 2, 4)]
    vision = tiny_encoders.vision.vision
    patches = torch.randn(
        sum(t * h * w for t, h, w in grids), vision.cfg.patch_dim, generator=torch.Generator().manual_seed(5)
    )
    with torch.inference_mode():
        want = vision(patches, grids)
        vision.attention = kind
        try:
            got = vision(patches, grids)
        finally:
            vision.attention = "auto"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
