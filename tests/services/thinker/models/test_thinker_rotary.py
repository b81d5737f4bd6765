"""video_rope with unequal axes vs a direct per-channel computation (ming.md §2.2 channel→axis rule)."""

from __future__ import annotations

import math

import pytest
import torch
from omnistage.services.thinker.models.layers.attention import AttentionMetadata, attention_metadata
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding


def _axis(i: int) -> int:
    j = i % 32
    if j >= 24:
        return 0  # t
    return 1 if j % 2 == 0 else 2  # h on even, w on odd


def _direct(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, H, 128]: channel c < 64 pairs with c ± 32 (NeoX), angle from its own axis; rest untouched."""
    out = x.clone()
    for t in range(x.shape[0]):
        for c in range(64):
            j = c % 32
            angle = float(pos[_axis(c), t]) * theta ** (-2 * j / 64)
            partner = x[t, :, c + 32] if c < 32 else x[t, :, c - 32]
            sign = -1.0 if c < 32 else 1.0
            out[t, :, c] = x[t, :, c] * math.cos(angle) + sign * partner * math.sin(angle)
    return out


def test_video_rope_matches_direct_per_channel():
    rope = RotaryEmbedding(head_dim=128, rotary_dim=64, theta=2.4e6, rope_type="video_rope")
    g = torch.Generator().manual_seed(0)
    pos = torch.stack(
        [torch.tensor([0, 3, 7, 7, 20]), torch.tensor([1, -2, 9, 5, 11]), torch.tensor([4, 0, 6, 13, 2])]
    )
    q = torch.randn(5, 2, 128, generator=g, dtype=torch.float64).float()
    k = torch.randn(5, 1, 128, generator=g, dtype=torch.float64).float()
    q2, k2 = rope(pos, q, k)
    torch.testing.assert_close(q2, _direct(q, pos, 2.4e6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k2, _direct(k, pos, 2.4e6), rtol=1e-5, atol=1e-5)
    assert torch.equal(q2[..., 64:], q[..., 64:])


def test_equal_axes_reduce_to_1d_rope():
    video = RotaryEmbedding(128, 64, 2.4e6, "video_rope")
    plain = RotaryEmbedding(128, 64, 2.4e6, "default")
    pos = torch.arange(9)
    q, k = torch.randn(9, 4, 128), torch.randn(9, 2, 128)
    for a, b in zip(video(pos.expand(3, -1), q, k), plain(pos, q, k), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cos_sin_cast_to_activation_dtype():
    rope = RotaryEmbedding(128, 64, 2.4e6)
    cos, sin = rope.cos_sin(torch.arange(4).expand(3, -1), torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (4, 64)


def _bound(rope_type: str, max_len: int) -> RotaryEmbedding:
    rope = RotaryEmbedding(128, 64, 2.4e6, rope_type)
    rope.bound_positions(max_len)
    return rope


def _positions(lo: int, hi: int, tokens: int, seed: int) -> torch.Tensor:
    """[3, T] positions over [lo, hi): both ends, the few before hi, the rest drawn."""
    edges = torch.tensor([lo, hi - 1, hi - 2, hi - 3, lo + 1, 0])
    drawn = torch.randint(lo, hi, (3, tokens), generator=torch.Generator().manual_seed(seed))
    drawn[:, : len(edges)] = torch.stack([edges, edges.flip(0), edges.roll(1)])
    return drawn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_type", ["default", "video_rope"])
def test_the_table_gives_the_computed_bits(rope_type, dtype):
    """Gathered cos/sin are the angles' computation's bits (the rope before the table), for every
    position of the span, its last ones included, whatever the step's token count."""
    rope, before = _bound(rope_type, 1000), RotaryEmbedding(128, 64, 2.4e6, rope_type)
    lo, hi = rope.span
    assert (lo, hi) == ((-500, 2000) if rope_type == "video_rope" else (0, 1000))
    for tokens, seed in [(6, 0), (7, 1), (300, 2)]:
        pos = _positions(lo, hi, tokens, seed)
        for got, want in zip(rope.cos_sin(pos, dtype), before.cos_sin(pos, dtype), strict=True):
            assert got.dtype == dtype and got.shape == (tokens, 64)
            assert torch.equal(got, want)
    every = torch.arange(lo, hi).expand(3, -1)
    for got, want in zip(rope.cos_sin(every, dtype), before.cos_sin(every, dtype), strict=True):
        assert torch.equal(got, want)
    one_d = torch.tensor([hi - 1, 0, hi - 2])  # [T] positions: 1D rope's (every axis the same)
    if rope_type == "default":
        for got, want in zip(rope.cos_sin(one_d, dtype), before.cos_sin(one_d, dtype), strict=True):
            assert torch.equal(got, want)


def test_the_table_is_made_once_a_dtype_and_its_bytes_are_the_span():
    rope = _bound("video_rope", 100)
    rope.cos_sin(torch.zeros(3, 2, dtype=torch.long), torch.bfloat16)
    table = rope.table(torch.device("cpu"), torch.bfloat16)
    assert table.lo == -50 and table.rows.shape == (250, 2, 64) and table.rows.dtype == torch.bfloat16
    assert table.rows.numel() * table.rows.element_size() == 250 * 64 * 2 * 2
    rope.cos_sin(torch.ones(3, 5, dtype=torch.long), torch.bfloat16)
    rope.bound_positions(100)  # a second runner over the same model: the tables a graph reads stay
    assert rope.table(torch.device("cpu"), torch.bfloat16) is table
    rope.bound_positions(101)
    assert rope.table(torch.device("cpu"), torch.bfloat16).rows.shape == (252, 2, 64)
    assert rope.table(torch.device("cpu"), torch.float32).rows.dtype == torch.float32


def test_a_position_past_the_table_takes_its_edge_row_and_unbounded_computes_again():
    rope = _bound("default", 10)
    cos, sin = rope.cos_sin(torch.tensor([-3, 12, 9]), torch.float32)
    edge_cos, edge_sin = rope.computed(torch.tensor([[0, 9, 9]]), torch.float32)
    assert torch.equal(cos, edge_cos) and torch.equal(sin, edge_sin)
    rope.bound_positions(None)
    assert rope.span is None
    cos, _ = rope.cos_sin(torch.tensor([12]), torch.float32)
    assert torch.equal(cos, rope.computed(torch.tensor([[12]]), torch.float32)[0])
    assert not torch.equal(cos, edge_cos[1:2])


def test_the_tiny_models_forward_is_bit_identical_with_the_table(tiny_model):
    """3D positions as an image prompt has them (spatial axes below zero, temporal ahead): the
    forward's hidden states with the table are the computed rope's, bit for bit."""
    t = torch.arange(12)
    positions = torch.stack([t * 2, t - 5, (t * 7) % 11 - 3])
    ids = torch.arange(12) * 37 % 1000
    with torch.inference_mode(), attention_metadata(AttentionMetadata.no_cache([12])):
        computed = tiny_model(ids, positions)
        tiny_model.bound_positions(12)
        try:
            gathered = tiny_model(ids, positions)
            assert tiny_model.model.rotary.span == (-6, 24)
        finally:
            tiny_model.bound_positions(None)
    assert torch.equal(gathered, computed)
