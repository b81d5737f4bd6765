"""RMSNorm (+ the residual add before it) and QK-norm + partial NeoX rope, one launch each.

A decode step is hundreds of small element-wise launches in the reference (each RMSNorm is seven);
these fold them. Rounding follows the reference (`layers/norm.py`, `layers/rotary.py`): the
residual sum and the normalised row are rounded to the activation dtype before the weight multiply.
The rope rounds after each product and the sum, as the reference's bf16 ops do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import pdl
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_prior_kernels(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
    h = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * norm(x) over the last dim; with `residual`: (weight * norm(x + residual), x + residual)."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if residual is None:
        r2, s2 = x2, out
    else:
        r2 = residual.reshape(-1, n)
        s2 = torch.empty_like(out)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            s2,
            n,
            eps,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            s2.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n),
            **pdl.launch(x.device),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), s2.view(shape)


@triton.jit
def _qk_norm_rope_kernel(
    qk_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    num_q_heads,
    eps,
    stride_t,
    stride_h,
    stride_ct,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_prior_kernels(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    half: tl.constexpr = ROT // 2
    partner = tl.where(d < half, d + half, d - half)
    rotated = d < ROT
    base = qk_ptr + t * stride_t + head * stride_h
    x = tl.load(base + d).to(tl.float32)
    xp = tl.load(base + partner, mask=rotated, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
        if head < num_q_heads:
            w = tl.load(qw_ptr + d).to(tl.float32)
            wp = tl.load(qw_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        else:
            w = tl.load(kw_ptr + d).to(tl.float32)
            wp = tl.load(kw_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        x = (x * rstd).to(qk_ptr.dtype.element_ty).to(tl.float32) * w
        xp = (xp * rstd).to(qk_ptr.dtype.element_ty).to(tl.float32) * wp
        x = x.to(qk_ptr.dtype.element_ty).to(tl.float32)
        xp = xp.to(qk_ptr.dtype.element_ty).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=rotated, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_ct + d, mask=rotated, other=0.0).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    # The reference's bf16 ops, each rounded: x * cos, rotate_half(x) * sin, their sum.
    dt = qk_ptr.dtype.element_ty
    out = (x * c).to(dt).to(tl.float32) + (sign * xp * s).to(dt).to(tl.float32)
    out = tl.where(rotated, out, x)
    tl.store(base + d, out.to(dt))


def qk_norm_rope(
    qk: torch.Tensor,
    num_q_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """In place on qk [T, Hq + Hk, D] (the q and k heads of one qkv row, adjacent): RMSNorm each
    head with its weight (when given), then NeoX rope on the first cos.shape[-1] dims."""
    t, heads, head_dim = qk.shape
    if t == 0:
        return
    if qk.stride(2) != 1:
        raise ValueError("qk_norm_rope: the head dim must be contiguous")
    norm = q_weight is not None
    cos, sin = cos.contiguous(), sin.contiguous()
    _qk_norm_rope_kernel[(t, heads)](
        qk,
        q_weight if norm else cos,
        k_weight if norm else cos,
        cos,
        sin,
        num_q_heads,
        eps,
        qk.stride(0),
        qk.stride(1),
        cos.stride(0),
        HEAD_DIM=head_dim,
        ROT=cos.shape[-1],
        NORM=norm,
        **pdl.launch(qk.device),
    )


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_prior_kernels(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < width
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0)
        # The reference's three bf16 ops (silu, then times up), each rounded to the activation dtype.
        act = (gate.to(tl.float32) * tl.sigmoid(gate.to(tl.float32))).to(x_ptr.dtype.element_ty)
        out = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate columns then up columns) → silu(gate) * up [T, I]."""
    t, two_i = x.shape
    out = torch.empty(t, two_i // 2, dtype=x.dtype, device=x.device)
    if t:
        _silu_mul_kernel[(t,)](
            x,
            out,
            two_i // 2,
            x.stride(0),
            out.stride(0),
            BLOCK=min(1024, triton.next_power_of_2(two_i // 2)),
            **pdl.launch(x.device),
        )
    return out
