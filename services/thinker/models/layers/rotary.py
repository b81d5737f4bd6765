"""Partial NeoX rotary embedding, 1D or Ming's 3D "video_rope" (ming.md §2.2).

video_rope: rotary pair i (of rotary_dim/2) takes its position from axis t, h or w. With
mrope_section [t, h, w] = [8, 12, 12] the 24 highest-frequency pairs are spatial, alternating h (even
i) and w (odd i), and the 8 lowest-frequency pairs are temporal. Angles are computed in fp32 and
cos/sin cast to the activation dtype before use; dims past rotary_dim pass through.
"""

from __future__ import annotations

import torch
from torch import nn

MROPE_SECTION = (8, 12, 12)


def video_rope_axes(half: int, section: tuple[int, int, int] = MROPE_SECTION) -> tuple[int, ...]:
    """Axis (0 t, 1 h, 2 w) of each of the `half` rotary frequency pairs."""
    t, h, w = section
    if t + h + w != half or h != w:
        raise ValueError(f"mrope_section {section} does not fit {half} rotary pairs")
    spatial = h + w
    return tuple((1 + i % 2) if i < spatial else 0 for i in range(half))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rope to q [T, H, D] and k [T, KVH, D] given positions [3, T] (or [T] for 1D)."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, rope_type: str = "video_rope") -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"bad rotary_dim {rotary_dim} for head_dim {head_dim}")
        if rope_type not in ("video_rope", "default"):
            raise ValueError(f"unsupported rope type {rope_type!r}")
        self.head_dim, self.rotary_dim, self.theta, self.rope_type = head_dim, rotary_dim, theta, rope_type
        self._axes = video_rope_axes(rotary_dim // 2) if rope_type == "video_rope" else None
        # The axes index per device, made once: no host-to-device copy inside a forward (CUDA graphs).
        self._axes_on: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float() / self.rotary_dim
        return 1.0 / (self.theta**exps)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rotary_dim] in `dtype` for positions [3, T] (video_rope) or [T]/[3, T] (1D)."""
        inv = self.inv_freq(positions.device)
        if positions.dim() == 1:
            positions = positions[None]
        if self._axes is None:
            angles = positions[0].float()[:, None] * inv[None, :]
        else:
            axes = self._axes_on.get(positions.device)
            if axes is None:
                axes = torch.tensor(self._axes, dtype=torch.long, device=positions.device)
                self._axes_on[positions.device] = axes
            pos = positions.float()[axes]  # [half, T]: each pair's axis
            angles = pos.t() * inv[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(*self.cos_sin(positions, q.dtype), q, k)

    def apply(
        self, cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope with cos/sin [T, rotary_dim] made once per forward (`cos_sin`), shared by every layer."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rope of heads x [T, H, D] on their first rotary_dim dims (cos/sin [T, rotary_dim], in
    x's dtype: each op rounds there); the dims past rotary_dim pass through."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
