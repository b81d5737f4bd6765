"""A step's rope cos/sin [T, rotary_dim] gathered from the model's table in one launch.

`RotaryEmbedding` (models/layers/rotary.py) makes cos/sin of every position the engine can pass
once (its `RopeTable`, rows [P, 2, rotary_dim] from position lo); a step then looks its tokens'
rows up here instead of computing the angles (~12 small kernels at the step's start, each on a
one-sequence decode's critical path). Column j of token t is the table's row of
positions[axes[j], t] (1D rope: every axis 0), cos and sin into one buffer [2, T, rotary_dim]. A
row index is clamped into the table: the engine's bound keeps every position inside it (rotary.py
`position_span`), and the clamp keeps anything else from being an out-of-bounds load. The torch
gather (`rotary.gather_reference`) is the CPU path and the reference.

Launched with PDL, waiting first: the positions may be written by the kernel just before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import pdl
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels

BLOCK_T = 16  # tokens a program: a decode token in one program, a prefill in T / 16


@triton.jit(do_not_specialize=["num_tokens", "stride_axis"])
def _rope_gather_kernel(
    rows_ptr,
    pos_ptr,
    axes_ptr,
    out_ptr,
    num_tokens,
    stride_axis,
    stride_t,
    lo,
    num_rows,
    ROT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program: BLOCK_T tokens' cos and sin rows (the table's row of each column's axis position)."""
    wait_for_prior_kernels(USE_PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.arange(0, BLOCK_R)
    inside = (t < num_tokens)[:, None] & (col < ROT)[None, :]
    axis = tl.load(axes_ptr + col, mask=col < ROT, other=0)
    pos = tl.load(pos_ptr + axis[None, :] * stride_axis + t[:, None] * stride_t, mask=inside, other=0)
    row = tl.minimum(tl.maximum(pos - lo, 0), num_rows - 1)
    src = rows_ptr + row * (2 * ROT) + col[None, :]
    dst = out_ptr + t[:, None] * ROT + col[None, :]
    tl.store(dst, tl.load(src, mask=inside), mask=inside)
    tl.store(dst + num_tokens * ROT, tl.load(src + ROT, mask=inside), mask=inside)


def gather(
    rows: torch.Tensor, lo: int, positions: torch.Tensor, axes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] (views of one [2, T, rotary_dim] buffer) of positions [A, T] (int)
    from table rows [P, 2, rotary_dim] (contiguous) starting at position `lo`; `axes` [rotary_dim]
    (int64, contiguous): each column's axis. One launch, none for T = 0."""
    num_rows, _, rot = rows.shape
    assert rows.is_contiguous() and axes.is_contiguous() and axes.shape == (rot,), "rope gather operands"
    num_tokens = positions.shape[-1]
    out = torch.empty(2, num_tokens, rot, dtype=rows.dtype, device=rows.device)
    if num_tokens:
        grid = (triton.cdiv(num_tokens, BLOCK_T),)
        _rope_gather_kernel[grid](
            rows,
            positions,
            axes,
            out,
            num_tokens,
            positions.stride(0),
            positions.stride(1),
            lo,
            num_rows,
            ROT=rot,
            BLOCK_T=BLOCK_T,
            BLOCK_R=triton.next_power_of_2(rot),
            **pdl.launch(rows.device),
        )
    return out[0], out[1]
