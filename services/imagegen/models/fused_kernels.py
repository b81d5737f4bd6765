"""The Triton kernels of `fused` (imported only on first use, so TRITON_INTERPRET set before that
takes effect). See `fused` for what each computes and its torch reference."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rms_norm_row(ptr, w_ptr, row, D, eps, BLOCK: tl.constexpr):
    """Row `row` of a [rows, D] tensor, RMS-normalised and × w, in fp32; with its columns and mask."""
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(ptr + row.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    return x * inv * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32), cols, mask


@triton.jit
def norm_modulate_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, tokens, D, eps, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # offsets past 2³¹ at 2048² edits with 8 requests
    y, cols, mask = _rms_norm_row(x_ptr, w_ptr, row, D, eps, BLOCK)
    if HAS_SCALE:
        y = y * (1.0 + tl.load(scale_ptr + (row // tokens) * D + cols, mask=mask, other=0.0).to(tl.float32))
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_gate_residual_kernel(
    res_ptr, h_ptr, w_ptr, gate_ptr, out_ptr, tokens, D, eps, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    y, cols, mask = _rms_norm_row(h_ptr, w_ptr, row, D, eps, BLOCK)
    if HAS_GATE:
        g = tl.load(gate_ptr + (row // tokens) * D + cols, mask=mask, other=0.0).to(tl.float32)
        e = tl.exp(-2.0 * tl.abs(g))  # tanh(g) = sign(g)(1 − e^{−2|g|}) / (1 + e^{−2|g|}), stable
        t = (1.0 - e) / (1.0 + e)
        y = y * tl.where(g < 0, -t, t)
    res = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (res + y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rope_head(src, dst, w_ptr, base, i, mask, c, s, HALF, eps):
    a = tl.load(src + base + 2 * i, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + base + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * HALF) + eps)
    a = a * inv * tl.load(w_ptr + 2 * i, mask=mask, other=0.0).to(tl.float32)
    b = b * inv * tl.load(w_ptr + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + base + 2 * i, (a * c - b * s).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + base + 2 * i + 1, (a * s + b * c).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    wq_ptr,
    wk_ptr,
    cos_ptr,
    sin_ptr,
    qo_ptr,
    ko_ptr,
    heads,
    cos_rows,
    HALF,
    eps,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # (token, head) of the flattened [B·N, heads]
    token = pid // heads
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    base = pid * 2 * HALF
    rope_row = (token % cos_rows) * HALF
    c = tl.load(cos_ptr + rope_row + i, mask=mask, other=0.0)
    s = tl.load(sin_ptr + rope_row + i, mask=mask, other=0.0)
    _norm_rope_head(q_ptr, qo_ptr, wq_ptr, base, i, mask, c, s, HALF, eps)
    _norm_rope_head(k_ptr, ko_ptr, wk_ptr, base, i, mask, c, s, HALF, eps)
