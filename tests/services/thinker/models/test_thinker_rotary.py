"""video_rope with unequal axes vs a direct per-channel computation (ming.md §2.2 channel→axis rule)."""

from __future__ import annotations

import math

import torch
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
