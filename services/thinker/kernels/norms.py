"""RMSNorm (+ the residual add before it) and QK-norm + partial NeoX rope, one launch each.

A decode step is hundreds of small element-wise launches in the reference (each RMSNorm is seven);
these fold them. Rounding follows the reference (`layers/norm.py`, `layers/rotary.py`): the
residual sum and the normalised row are rounded to the activation dtype before the weight multiply.
The rope rounds after each product and the sum, as the reference's bf16 ops do. The QK-norm + rope
rule is one @triton.jit helper (`norm_rope_heads`): this module's launch, the decode attention
launch (`paged_attention.paged_decode(..., qk_rope=...)`, a decode step with the fusions on) and
the qkv projection's epilogue (`resident_gemv.resident_gemv(..., rope=...)`, one or two tokens whose
attention does not fold it) all call it, so the paths cannot drift apart. The RMSNorm arithmetic itself is one set of
@triton.jit helpers (`add_residual`, `sum_of_squares`, `rms_rstd`, `rms_scale`): `_rms_norm_kernel`,
`norm_rope_heads`, the weights-first projection (`resident_gemv.py`), and the router and the dense
gate-up with the post-attention norm folded in (`router.py`, `dense_gate_up.py`) all call them, so a folded norm is the separate launch's
bit for bit. The sum of squares is accumulated in fp64: a bf16 (or fp16) square is exact there, and
so is the sum of a row's squares whatever order a launch's layout reduces in (up to 4096 elements
whose nonzero magnitudes span less than 2^12; beyond, the fp64 sums agree to ~2^-41 relative, so
their fp32 roundings almost always do; for fp32 activations the same holds of the fp64 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import pdl
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels


@triton.jit
def add_residual(x, residual):
    """The residual add before a norm: x + residual in fp32, rounded to x's dtype (the reference's
    add in the activation dtype)."""
    return (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)


@triton.jit
def sum_of_squares(h, axis: tl.constexpr, keep_dims: tl.constexpr = False):
    """The fp64 sum of h's squares along `axis` (exact for a bf16 row: see the module docstring);
    a row read in chunks adds its chunks' sums."""
    h = h.to(tl.float64)
    return tl.sum(h * h, axis=axis, keep_dims=keep_dims)


@triton.jit
def rms_rstd(total, n, eps):
    """1 / sqrt(mean square + eps) in fp32: the row's fp64 sum of squares `total` rounded to fp32,
    over its n elements."""
    return 1.0 / tl.sqrt(total.to(tl.float32) / n + eps)


@triton.jit
def rms_scale(h, rstd, w, dt: tl.constexpr):
    """weight * norm(h) as the reference rounds: h * rstd in fp32, rounded to `dt` (the activation
    dtype), times the norm weight `w` in fp32, rounded to `dt`."""
    normed = (h.to(tl.float32) * rstd).to(dt).to(tl.float32)
    return (w.to(tl.float32) * normed).to(dt)


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
        x = add_residual(x, tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0))
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    rstd = rms_rstd(sum_of_squares(x, 0), n, eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, rms_scale(x, rstd, w, x_ptr.dtype.element_ty), mask=ok)


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
def norm_rope_heads(
    rows, ok, w_ptr, cos_row, sin_row, eps, ROT: tl.constexpr, NORM: tl.constexpr, CACHE: tl.constexpr
):
    """The QK-norm + rope rule, its one owner (the separate launch below, the decode attention
    launch, `paged_attention._decode_kernel`, and the qkv projection's epilogue,
    `resident_gemv._qk_rope_epilogue`, which fold it in): heads at the pointers `rows`
    [..., D] (the last axis a head's D contiguous elements; `ok`, broadcast to them, the heads to
    load, zeros elsewhere) RMSNormed with the weight at `w_ptr` when NORM, then NeoX rope on their
    first ROT dims with the token's cos/sin at `cos_row`/`sin_row` → the heads in their dtype.
    CACHE: the heads' loads' cache modifier (".cg": past L1, rows other programs of the launch
    stored; the loaded values, so the result, are the same).

    The reference's bf16 roundings (`rms_scale`): rstd in fp32, the normed head rounded, times the
    weight, rounded; each rope product rounded, then their sum. The sum of squares is accumulated in
    fp64 (`sum_of_squares`): exact for a bf16 head (up to 128 dims whose nonzero magnitudes span
    less than 2^14), whatever order a launch's layout reduces in: both launches get the same rstd,
    not merely the same rounding steps."""
    HEAD_DIM: tl.constexpr = rows.shape[-1]
    half: tl.constexpr = ROT // 2
    d = tl.arange(0, HEAD_DIM)
    partner = tl.where(d < half, d + half, d - half)
    rotated = d < ROT
    dt = rows.dtype.element_ty
    x = tl.load(rows, mask=ok, other=0.0, cache_modifier=CACHE).to(tl.float32)
    xp = tl.load(rows + (partner - d), mask=ok & rotated, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if NORM:
        rstd = rms_rstd(sum_of_squares(x, -1, keep_dims=True), HEAD_DIM, eps)
        w = tl.load(w_ptr + d)
        wp = tl.load(w_ptr + partner, mask=rotated, other=0.0)
        x = rms_scale(x, rstd, w, dt).to(tl.float32)
        xp = rms_scale(xp, rstd, wp, dt).to(tl.float32)
    c = tl.load(cos_row + d, mask=rotated, other=1.0).to(tl.float32)
    s = tl.load(sin_row + d, mask=rotated, other=0.0).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    # The reference's bf16 ops, each rounded: x * cos, rotate_half(x) * sin, their sum.
    out = (x * c).to(dt).to(tl.float32) + (sign * xp * s).to(dt).to(tl.float32)
    return tl.where(rotated, out, x).to(dt)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    num_q_heads,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (token, head): a query head (head < num_q_heads) or a key head, in place."""
    wait_for_prior_kernels(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    if head < num_q_heads:
        rows = q_ptr + t * stride_qt + head * stride_qh + d
        w_ptr = qw_ptr
    else:
        rows = k_ptr + t * stride_kt + (head - num_q_heads) * stride_kh + d
        w_ptr = kw_ptr
    out = norm_rope_heads(
        rows, d < HEAD_DIM, w_ptr, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct, eps, ROT, NORM, ""
    )
    tl.store(rows, out)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """In place on q [T, Hq, D] and k [T, Hk, D] (views of the qkv rows, say), one launch: RMSNorm
    each head with its weight (both given, or neither: no norm), then NeoX rope on the first
    cos.shape[-1] dims with cos/sin [T, rotary_dim] (`norm_rope_heads`)."""
    (t, q_heads, head_dim), k_heads = q.shape, k.shape[1]
    if t == 0:
        return
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("qk_norm_rope: the head dim must be contiguous")
    norm = q_weight is not None
    cos, sin = cos.contiguous(), sin.contiguous()
    _qk_norm_rope_kernel[(t, q_heads + k_heads)](
        q,
        k,
        q_weight if norm else cos,
        k_weight if norm else cos,
        cos,
        sin,
        q_heads,
        eps,
        *q.stride()[:2],
        *k.stride()[:2],
        cos.stride(0),
        HEAD_DIM=head_dim,
        ROT=cos.shape[-1],
        NORM=norm,
        **pdl.launch(q.device),
    )


@triton.jit
def silu_mul(gate, up, dt: tl.constexpr):
    """silu(gate)·up in `dt` with the reference's roundings (its bf16 ops, each rounded): gate and up
    to `dt` (an fp32 GEMM sum, or a value already in `dt`), silu, then the product. The one rule of
    every kernel that applies the MLPs' activation."""
    gate = gate.to(dt).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
    return (act * up.to(dt).to(tl.float32)).to(dt)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_prior_kernels(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < width
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0)
        out = silu_mul(gate, up, x_ptr.dtype.element_ty)
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
