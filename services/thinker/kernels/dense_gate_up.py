"""The dense MLP's gate-up projection and its SiLU·mul for one or two tokens in one launch:
h[t, j] = silu(x[t]·Wg[j]) · (x[t]·Wu[j]), from the merged column-parallel weight [2I, H] (this
rank's gate rows, then its up rows: `MergedColumnParallelLinear`), so a rank's shard is whole.

Ling-mini's and Ming-flash's first layer is dense (`first_k_dense_replace`); at one decode token its
gate-up (42 MB at Ling-mini, 75 MB a rank at Ming-flash TP=2) went through cuBLAS and then the
SiLU·mul in a launch of its own. Here the launch is one wave of programs (a few an SM,
`default_tiles`), each streaming its tiles of `rows` intermediate rows of gate and up with the next tile's reads in
flight while it computes the current one (the design of `moe_one_token`'s streaming gate-up), and
each loading its first tile before its PDL wait (a static operand, `pdl.STATIC_OPERANDS`, as
`resident_gemv` does), so those reads overlap the kernel before. Products and sums in fp32 on CUDA
cores (a row or two: no tensor-core tile to fill), then `norms.silu_mul`'s roundings (gate and up
rounded to the activation dtype, the SiLU, the product): the reference's, with its sums in another
order. One fixed reduction order per compile, whatever program computes a tile (graphs = eager,
bit for bit). Not measured yet: the constants are the streaming gate-up's (`moe_one_token`) and the
compile's register counts.

The decoder layer's post-attention add + RMSNorm before it folds in (`normed_gate_up_act`, issue 40:
one launch fewer on a one-sequence step's critical path): every program holds the token's whole row
anyway, so after its wait each loads x and the residual and norms the row itself with
`norms.rms_norm`'s helpers (its normed row and residual sum bit for bit; the norm weight, static,
read before the wait), and program 0 stores the residual sum for the layers after. Under TP the
gate-up is column-parallel: each rank holds the whole (all-reduced) row and keeps its own residual
stream, as a MoE layer's router fold does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import interpreting, pdl
from omnistage.services.thinker.kernels.moe_one_token import sm_count
from omnistage.services.thinker.kernels.norms import (
    add_residual,
    rms_rstd,
    rms_scale,
    silu_mul,
    sum_of_squares,
)
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels

# Tokens a launch serves: each is a pass over the streamed tiles (a decode step of one or two
# sequences; more amortise the weight reads, and cuBLAS then the SiLU·mul launch serve them).
MAX_TOKENS = 2
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Rows a tile, and at most this many programs an SM: `moe_one_token`'s streaming gate-up
# measurements (one H200, 2026-11-29, bench/moe_one_token_gpu.py: 2 rows, 4 programs an SM at
# Ling-mini's hidden size, 2 an SM a little faster at Ming-flash's; tiles of 8 rows spilled with two
# in flight). bench/resident_gemv_gpu.py times this kernel at the dense shapes, with a sweep.
STREAM_ROWS, STREAM_PROGRAMS_PER_SM = 2, 4
# Weight bytes a program holds (two tiles of gate and up rows: the current and the next), and an
# SM's programs together (`default_tiles`: 4 programs at Ling-mini's hidden size, 2 at Ming-flash's).
_PROGRAM_BYTES = 64 * 1024
_SM_BYTES = 128 * 1024
# Elements of the token rows a program of 4 warps holds; past it 8 warps. Compiled for sm_90 (this
# Triton, ptxas; registers as cuobjdump reports them), 2 rows a tile: one token at hidden 2048 127
# registers, at 4096 205; two tokens at 2048 211; two at 4096 255 with 320 bytes of stack at 4
# warps, 210 and none at 8.
_WARP4_ELEMENTS = 4096
# Up to this many tokens the add + norm folds in (`serves_normed`). Compiled for sm_90 as a launch
# specializes (sizes divisible by 16, aligned pointers; cuobjdump), default tiles: one token at
# hidden 2048 72 registers, 80 folded; at 4096 125, 168 folded (2 programs an SM: fits); two tokens
# at 2048 128, 157 folded (3 of the 4 programs an SM fit the register file, not 4); two at 4096 (8
# warps) 128, 158 folded (1 of 2). At two tokens LLVM also orders the loop's sums otherwise than
# the unfolded compile (at one token the loop's IR is the same: the same bits). Unmeasured
# (bench/resident_gemv_gpu.py --dense-only --tokens 2 times the folded launch).
NORM_MAX_TOKENS = 1


@dataclass(frozen=True)
class DenseTiles:
    """Intermediate rows a tile (of the gate and of the up weight each), the programs that stream
    the tiles, and their warps."""

    rows: int
    programs: int
    warps: int = 4


def tile_rows(hidden: int, element_size: int) -> int:
    """The most rows (a power of two, at most STREAM_ROWS) whose two tiles of gate and up rows fit
    `_PROGRAM_BYTES`; 0 when not even one row does."""
    fit = _PROGRAM_BYTES // (4 * triton.next_power_of_2(hidden) * element_size)
    return min(STREAM_ROWS, 1 << (fit.bit_length() - 1)) if fit else 0


def default_tiles(hidden: int, inter: int, element_size: int, sms: int, tokens: int = 1) -> DenseTiles:
    """`tile_rows` rows a tile; on each of `sms` SMs as many programs as `_SM_BYTES` holds (at most
    STREAM_PROGRAMS_PER_SM), no more programs than tiles; 4 warps, 8 past `_WARP4_ELEMENTS`."""
    h_pad = triton.next_power_of_2(hidden)
    rows = min(tile_rows(hidden, element_size), triton.next_power_of_2(inter))
    per_sm = min(STREAM_PROGRAMS_PER_SM, max(1, _SM_BYTES // (4 * rows * h_pad * element_size)))
    programs = max(1, min(per_sm * sms, triton.cdiv(inter, rows)))
    return DenseTiles(rows, programs, 4 if tokens * h_pad <= _WARP4_ELEMENTS else 8)


def chooses_kernel(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """The one dispatch rule: ≤ MAX_TOKENS rows, a supported dtype (x's and the weight's), a
    contiguous 2-D weight of gate and up rows (an even count) over x's width whose rows fit a
    program (`tile_rows`), on CUDA (or anywhere under TRITON_INTERPRET=1)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (
        0 < rows <= MAX_TOKENS
        and gate_up.dim() == 2
        and gate_up.shape[0] > 0
        and gate_up.shape[0] % 2 == 0
        and x.dtype in DTYPES
        and gate_up.dtype == x.dtype
        and gate_up.is_contiguous()
        and x.shape[-1] == gate_up.shape[1]
        and tile_rows(gate_up.shape[1], gate_up.element_size()) > 0
        and (x.is_cuda and gate_up.is_cuda or interpreting())
    )


@triton.jit
def _tile_weights(w_ptr, t, inter, hidden, BLOCK_N: tl.constexpr, H_PAD: tl.constexpr):
    """Tile t's gate rows and up rows [BLOCK_N, H_PAD] (intermediate columns [t·BLOCK_N, +BLOCK_N));
    zeros past the last tile."""
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, H_PAD)
    mask = (cols < inter)[:, None] & (ks < hidden)[None, :]
    rows = cols.to(tl.int64)[:, None] * hidden + ks[None, :]
    gate = tl.load(w_ptr + rows, mask=mask, other=0.0)
    return gate, tl.load(w_ptr + inter * hidden + rows, mask=mask, other=0.0)


@triton.jit
def _finish_row(gate_w, up_w, x, t, h_ptr, inter, BLOCK_N: tl.constexpr):
    """silu(gate)·up of tile t for one token's row x (fp32 sums, `silu_mul`'s roundings) into h's
    row at h_ptr, at the tile's columns."""
    xf = x.to(tl.float32)[None, :]
    gate = tl.sum(gate_w.to(tl.float32) * xf, axis=1)
    up = tl.sum(up_w.to(tl.float32) * xf, axis=1)
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + cols, silu_mul(gate, up, h_ptr.dtype.element_ty), mask=cols < inter)


@triton.jit
def _token_row(x_ptr, r_ptr, sum_ptr, norm_w, ks, hidden, eps, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """A token's row as the gate-up reads it [H_PAD]: x's at x_ptr, or with NORM weight *
    norm(x (+ the residual at r_ptr)) as `norms.rms_norm` makes it (its helpers, bit for bit),
    program 0 storing x + residual at sum_ptr (every program holds the whole row: each norms it)."""
    ok = ks < hidden
    x = tl.load(x_ptr + ks, mask=ok, other=0.0)
    if RESIDUAL:
        x = add_residual(x, tl.load(r_ptr + ks, mask=ok, other=0.0))
        if tl.program_id(0) == 0:
            tl.store(sum_ptr + ks, x, mask=ok)
    if NORM:
        x = rms_scale(x, rms_rstd(sum_of_squares(x, 0), hidden, eps), norm_w, x_ptr.dtype.element_ty)
    return x


@triton.jit
def _dense_gate_up_kernel(
    x_ptr,
    r_ptr,
    norm_w_ptr,
    w_ptr,
    h_ptr,
    sum_ptr,
    inter,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_s,
    TWO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    H_PAD: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program p of P: tiles p, p + P, ... (`_tile_weights`), the next tile's weights loaded before
    the current tile's products; tile p's read before the wait (the weight: a static operand), and
    with NORM the norm weight (static too); the token rows (x[0], and x[1] when TWO, with their
    residual rows when RESIDUAL: `_token_row`) after it. Without NORM, r, norm_w, sum and eps are
    unread."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, H_PAD)
    mask = (cols < inter)[:, None] & (ks < hidden)[None, :]
    rows = cols.to(tl.int64)[:, None] * hidden + ks[None, :]
    gate_w = tl.load(w_ptr + rows, mask=mask, other=0.0)
    up_w = tl.load(w_ptr + inter * hidden + rows, mask=mask, other=0.0)
    if NORM:
        norm_w = tl.load(norm_w_ptr + ks, mask=ks < hidden, other=0.0)
    else:
        norm_w = 0.0
    wait_for_prior_kernels(USE_PDL)
    x0 = _token_row(x_ptr, r_ptr, sum_ptr, norm_w, ks, hidden, eps, NORM, RESIDUAL)
    x1 = x0
    if TWO:
        x1_ptr, r1_ptr, sum1_ptr = x_ptr + stride_x, r_ptr + stride_r, sum_ptr + stride_s
        x1 = _token_row(x1_ptr, r1_ptr, sum1_ptr, norm_w, ks, hidden, eps, NORM, RESIDUAL)
    t = tl.program_id(0)
    for _ in range(tl.program_id(0), tl.cdiv(inter, BLOCK_N), tl.num_programs(0)):
        after = t + tl.num_programs(0)
        gate_next, up_next = _tile_weights(w_ptr, after, inter, hidden, BLOCK_N, H_PAD)
        _finish_row(gate_w, up_w, x0, t, h_ptr, inter, BLOCK_N)
        if TWO:
            _finish_row(gate_w, up_w, x1, t, h_ptr + inter, inter, BLOCK_N)
        gate_w, up_w, t = gate_next, up_next, after


def silu_gate_up(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    tiles: DenseTiles | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, H] (M ≤ MAX_TOKENS), gate_up [2I, H] (gate rows, then up rows) → silu(x @ Wgᵀ) ·
    (x @ Wuᵀ) [M, I] in x's dtype, as F.linear then `norms.silu_and_mul` round it. `norm` = (norm
    weight [H], eps): of weight * norm(x) instead, and with `residual` of norm(x + residual),
    returning (h, x + residual) -- `norms.rms_norm`'s normed row and sum bit for bit, one launch."""
    m, hidden = x.shape
    if m > MAX_TOKENS:
        raise ValueError(f"silu_gate_up: {m} tokens, at most {MAX_TOKENS}")
    if residual is not None and norm is None:
        raise ValueError("silu_gate_up: a residual is only added before a norm")
    inter = gate_up.shape[0] // 2
    tiles = tiles or default_tiles(hidden, inter, x.element_size(), sm_count(x.device), m)
    x = x.contiguous()
    h = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x) if residual is not None else h
    r = residual.contiguous() if residual is not None else x
    norm_w, eps = norm if norm is not None else (gate_up, 0.0)  # unread without NORM: the weight
    if m:
        _dense_gate_up_kernel[(tiles.programs,)](
            x,
            r,
            norm_w,
            gate_up,
            h,
            total,
            inter,
            hidden,
            eps,
            x.stride(0),
            r.stride(0),
            total.stride(0),
            TWO=m == 2,
            BLOCK_N=tiles.rows,
            H_PAD=triton.next_power_of_2(hidden),
            NORM=norm is not None,
            RESIDUAL=residual is not None,
            num_warps=tiles.warps,
            num_stages=1,
            **pdl.launch(x.device),
        )
    return h if residual is None else (h, total)


def gate_up_act(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate(x)) · up(x) [..., I] through `silu_gate_up` where `chooses_kernel` says so; None
    elsewhere (the caller projects, then runs the SiLU·mul)."""
    if not chooses_kernel(x, gate_up):
        return None
    lead = x.shape[:-1]
    return silu_gate_up(x.reshape(-1, x.shape[-1]), gate_up).view(*lead, gate_up.shape[0] // 2)


def serves_normed(x: torch.Tensor, gate_up: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """`normed_gate_up_act`'s rule: `chooses_kernel`, at most NORM_MAX_TOKENS tokens, and a norm
    weight in x's dtype."""
    rows = x.numel() // max(1, x.shape[-1])
    return chooses_kernel(x, gate_up) and rows <= NORM_MAX_TOKENS and norm_weight.dtype == x.dtype


def normed_gate_up_act(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(silu(gate(h)) · up(h) [..., I], x + residual) for h = norm(x + residual) in one launch —
    with no residual (that of h = norm(x), x) — where `serves_normed` says so: the decoder layer's
    post-attention add + RMSNorm folded into the dense gate-up (`norms.rms_norm`, then
    `gate_up_act`, bit for bit); None elsewhere (the caller norms, then runs the MLP)."""
    if not serves_normed(x, gate_up, norm_weight):
        return None
    lead, hidden, inter = x.shape[:-1], x.shape[-1], gate_up.shape[0] // 2
    rows = x.reshape(-1, hidden)
    if residual is None:
        return silu_gate_up(rows, gate_up, norm=(norm_weight, eps)).view(*lead, inter), x
    h, total = silu_gate_up(rows, gate_up, norm=(norm_weight, eps), residual=residual.reshape(-1, hidden))
    return h.view(*lead, inter), total.view(x.shape)
