"""Partial NeoX rotary embedding, 1D or Ming's 3D "video_rope" (ming.md §2.2).

video_rope: rotary pair i (of rotary_dim/2) takes its position from axis t, h or w. With
mrope_section [t, h, w] = [8, 12, 12] the 24 highest-frequency pairs are spatial, alternating h (even
i) and w (odd i), and the 8 lowest-frequency pairs are temporal. Angles are computed in fp32 and
cos/sin cast to the activation dtype before use; dims past rotary_dim pass through.

A step's cos/sin: once the engine has bounded the positions (`bound_positions`, from its
max_model_len), gathered from a table of every position it can pass, made once a device and dtype
by the same ops as the computation (so the values are its bits): one launch a step on a GPU
(kernels/rope_table.py) in place of the ~12 small kernels of the angles; unbounded, computed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from omnistage.services.thinker.kernels import triton_available
from omnistage.services.thinker.models.rope_index import position_span as video_span
from torch import nn

MROPE_SECTION = (8, 12, 12)


def video_rope_axes(half: int, section: tuple[int, int, int] = MROPE_SECTION) -> tuple[int, ...]:
    """Axis (0 t, 1 h, 2 w) of each of the `half` rotary frequency pairs."""
    t, h, w = section
    if t + h + w != half or h != w:
        raise ValueError(f"mrope_section {section} does not fit {half} rotary pairs")
    spatial = h + w
    return tuple((1 + i % 2) if i < spatial else 0 for i in range(half))


def position_span(rope_type: str, max_len: int) -> tuple[int, int]:
    """[lo, hi): every position the engine passes a forward (max_len: its max_model_len). 1D rope
    takes a token's index, below max_len (no other positions are made for it:
    `multimodal._positions`); video_rope also a prompt's 3D positions and rope_delta
    (`rope_index.position_span`'s argument)."""
    return video_span(max_len) if rope_type == "video_rope" else (0, max_len)


class RopeTable(NamedTuple):
    """cos/sin of positions lo .. lo + P − 1: rows [P, 2, rotary_dim] (cos, then sin) in a dtype."""

    rows: torch.Tensor
    lo: int


def _cos_sin(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 angles [N, rotary_dim / 2] → cos, sin [N, rotary_dim] in `dtype` (NeoX halves)."""
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def gather_reference(
    table: RopeTable, positions: torch.Tensor, columns: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rotary_dim] of positions [A, T] from `table` by torch: column j of token t is row
    positions[columns[j], t] (clamped into the table: kernels/rope_table.py's rule)."""
    rows = table.rows
    index = (positions[columns] - table.lo).clamp(0, rows.shape[0] - 1).t()
    return rows[:, 0].gather(0, index), rows[:, 1].gather(0, index)


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
        # The axis index of each pair and of each column per device, made once: no host-to-device
        # copy inside a forward (CUDA graphs).
        self._axes_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.span: tuple[int, int] | None = None  # `bound_positions`' [lo, hi); None: computed
        self._tables: dict[tuple[torch.device, torch.dtype], RopeTable] = {}

    def bound_positions(self, max_len: int | None) -> None:
        """From now on every position passed lies in `position_span(rope_type, max_len)` (the
        engine's max_model_len: ModelRunner says so), and cos/sin are gathered from a table of that
        span; None: computed again. Table bytes: (hi − lo) · rotary_dim · 2 · the dtype's. The same
        span keeps the tables made (a CUDA graph captured reads them); another drops them, so it
        must come before any capture."""
        span = None if max_len is None else position_span(self.rope_type, max_len)
        if span != self.span:
            self.span = span
            self._tables.clear()

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float() / self.rotary_dim
        return 1.0 / (self.theta**exps)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rotary_dim] in `dtype` for positions [3, T] (video_rope) or [T]/[3, T] (1D):
        gathered from the table once bounded (a launch on a GPU with triton), else computed."""
        if positions.dim() == 1:
            positions = positions[None]
        if self.span is None:
            return self.computed(positions, dtype)
        table, (_, columns) = self.table(positions.device, dtype), self._axes_index(positions.device)
        if positions.device.type == "cuda" and triton_available():
            from omnistage.services.thinker.kernels import rope_table

            return rope_table.gather(table.rows, table.lo, positions, columns)
        return gather_reference(table, positions, columns)

    def computed(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions [A, T] by the angles' ops (a table's rows are made by the same)."""
        inv = self.inv_freq(positions.device)
        if self._axes is None:
            angles = positions[0].float()[:, None] * inv[None, :]
        else:
            pos = positions.float()[self._axes_index(positions.device)[0]]  # [half, T]: each pair's axis
            angles = pos.t() * inv[None, :]
        return _cos_sin(angles, dtype)

    def table(self, device: torch.device, dtype: torch.dtype) -> RopeTable:
        """The bounded span's table on `device` in `dtype`, made at its first use: each row by
        `computed`'s ops on the same fp32 values (float(p) · inv[i]), so a gathered row is its bits.
        Made outside a CUDA graph capture (the capture's eager run before it makes it)."""
        assert self.span is not None, "table: bound_positions first"
        table = self._tables.get((device, dtype))
        if table is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("rope table: first made inside a CUDA graph capture; run a forward first")
            lo, hi = self.span
            positions = torch.arange(lo, hi, dtype=torch.int64, device=device)
            cos, sin = _cos_sin(positions.float()[:, None] * self.inv_freq(device)[None, :], dtype)
            table = self._tables[device, dtype] = RopeTable(torch.stack((cos, sin), dim=1), lo)
        return table

    def _axes_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The axis of each rotary pair [rotary_dim / 2] and of each column [rotary_dim] (the pair's,
        for both halves; all 0 for 1D rope) on `device`."""
        index = self._axes_on.get(device)
        if index is None:
            pairs = torch.tensor(self._axes or (0,) * (self.rotary_dim // 2), dtype=torch.long, device=device)
            index = self._axes_on[device] = (pairs, torch.cat((pairs, pairs)))
        return index

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
