"""A decode step's projection with its weights read before the wait: y = x @ Wᵀ for one or a few
tokens, optionally of norm(x + residual) (RMSNorm with the residual add, as `norms.rms_norm`).

With PDL (`pdl.py`) the next kernel's programs are resident while the current one runs, and a
projection's weights never depend on an earlier kernel: each program here loads its whole weight
slice (BLOCK_N rows x all of K) into registers, and only then waits for the prior kernels and reads
the activations. Measured on an H200 (bench/resident_gemv_gpu.py), what pays is the whole slice in
flight at once (Ling-mini's o alone 3.2 µs against cuBLAS's 6.1); the reads overlapped little of
the kernel before (a decode attention then o: 10.7 µs against 7.7 + 3.2 alone). After the wait
comes one activation row from L2, a row product, and a store. The norm's statistics need the whole row, which
every program holds anyway, so the add + RMSNorm before a projection folds in (program 0 stores the
residual sum for the layers after). Products and sums in fp32 on CUDA cores (a row or two: no
tensor-core tile to fill), one fixed reduction order per compile (graphs = eager, bit for bit).

The weights a program holds are bounded (`fits`): a slice has to stay in registers, and the whole
weight at most about two waves of programs (a weight all resident at once overlaps best).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import interpreting, pdl
from omnistage.services.thinker.kernels.norms import add_residual, rms_rstd, rms_scale, sum_of_squares
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels

# Tokens a launch serves: each is a pass over the resident weights (a decode step of one or two
# sequences; more amortise the weight reads and the tiled GEMV / cuBLAS serve them).
MAX_TOKENS = 2
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Weight bytes one thread holds (~64 of its registers), and the largest weight the kernel takes: about
# two waves of an H200's programs (132 SMs x ~128 KiB of registers). One H200, 2026-11-29
# (bench/resident_gemv_gpu.py --force): Ming-flash TP=2's qkv (21 MB, past one wave) 6.7 µs against
# cuBLAS's 10.3, and with the add + norm folded 8.2 against 11.4 for the norm then cuBLAS.
_THREAD_BYTES = 256
_RESIDENT_BYTES = 24 * 1024 * 1024


@dataclass(frozen=True)
class ResidentConfig:
    """Weight rows a program and its warps (the slice is rows x the whole K)."""

    block_n: int = 8
    warps: int = 4


# Warps a program: one H200, 2026-11-29 (bench/resident_gemv_gpu.py, graph-timed, one token): Ling-mini's
# qkv 4.0 µs at 8 rows x 4 warps (4.9 at 8 x 8, 5.4 at 16 x 8), its o 3.2 at either; Ming-flash TP=2's o
# 5.7 at 4 rows x 4 warps (5.9 at 8 x 4): the most rows whose slice is `_THREAD_BYTES` a thread of 4 warps.
_WARPS = 4


def default_config(n: int, k: int, element_size: int) -> ResidentConfig:
    """The most rows a program whose slice fits `_THREAD_BYTES` a thread at `_WARPS` warps."""
    k_pad = triton.next_power_of_2(k)
    rows = max(1, (_THREAD_BYTES * _WARPS * 32) // (k_pad * element_size))
    return ResidentConfig(block_n=min(triton.next_power_of_2(n), 1 << (rows.bit_length() - 1)), warps=_WARPS)


def fits(n: int, k: int, element_size: int) -> bool:
    """Whether the whole weight can be resident at once (`_RESIDENT_BYTES`) and one row in a
    program's registers."""
    row_ok = triton.next_power_of_2(k) * element_size <= _WARPS * 32 * _THREAD_BYTES
    return n * k * element_size <= _RESIDENT_BYTES and row_ok


def chooses_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The one dispatch rule: ≤ MAX_TOKENS rows, a supported dtype (x's and the weight's), a
    contiguous 2-D weight that `fits`, on CUDA (or anywhere under TRITON_INTERPRET=1)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (
        0 < rows <= MAX_TOKENS
        and weight.dim() == 2
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[1]
        and fits(weight.shape[0], weight.shape[1], weight.element_size())
        and (x.is_cuda and weight.is_cuda or interpreting())
    )


@triton.jit(do_not_specialize=["m"])
def _resident_gemv_kernel(
    x_ptr,
    r_ptr,
    norm_w_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    m,
    n,
    k,
    eps,
    stride_x,
    stride_r,
    stride_w,
    stride_o,
    stride_s,
    BLOCK_N: tl.constexpr,
    K_PAD: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program n: output columns [n·BLOCK_N, +BLOCK_N) of every row. Its weight rows (and the norm
    weight) are loaded before the wait: static operands (pdl.STATIC_OPERANDS), never written by a
    kernel. NORM: the row is weight * norm(x (+ residual)) first, `norms.rms_norm`'s row bit for bit
    (its helpers)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K_PAD)
    col_ok, k_ok = cols < n, ks < k
    w = tl.load(
        w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :],
        mask=col_ok[:, None] & k_ok[None, :],
        other=0.0,
    )
    if NORM:
        norm_w = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0)
    wait_for_prior_kernels(USE_PDL)
    dt = x_ptr.dtype.element_ty
    for row in range(m):
        x = tl.load(x_ptr + row * stride_x + ks, mask=k_ok, other=0.0)
        if RESIDUAL:
            x = add_residual(x, tl.load(r_ptr + row * stride_r + ks, mask=k_ok, other=0.0))
            if tl.program_id(0) == 0:
                tl.store(sum_ptr + row * stride_s + ks, x, mask=k_ok)
        if NORM:
            x = rms_scale(x, rms_rstd(sum_of_squares(x, 0), k, eps), norm_w, dt)
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)


def resident_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    config: ResidentConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] @ weight [N, K]ᵀ → [M, N] in x's dtype (M ≤ MAX_TOKENS). `norm` = (norm weight [K],
    eps): of norm(x) instead, and with `residual` of norm(x + residual), returning (y, x + residual)
    as `norms.rms_norm` returns its sum."""
    if residual is not None and norm is None:
        raise ValueError("resident_gemv: a residual is only added before a norm")
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or default_config(n, k, weight.element_size())
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x) if residual is not None else out
    r = residual.contiguous() if residual is not None else x
    norm_w, eps = norm if norm is not None else (weight, 0.0)
    if m:
        _resident_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x,
            r,
            norm_w,
            weight,
            out,
            total,
            m,
            n,
            k,
            eps,
            x.stride(0),
            r.stride(0),
            weight.stride(0),
            out.stride(0),
            total.stride(0),
            BLOCK_N=cfg.block_n,
            K_PAD=triton.next_power_of_2(k),
            NORM=norm is not None,
            RESIDUAL=residual is not None,
            num_warps=cfg.warps,
            **pdl.launch(x.device),
        )
    return out if residual is None else (out, total)


def linear(x: torch.Tensor, weight: torch.Tensor, fallback: Callable | None = None) -> torch.Tensor:
    """F.linear(x, weight) (no bias) through `resident_gemv` where `chooses_kernel` says so, else
    through `fallback` (the tiled GEMV's dispatch, when on) or F.linear."""
    if not chooses_kernel(x, weight):
        return (fallback or F.linear)(x, weight)
    lead = x.shape[:-1]
    return resident_gemv(x.reshape(-1, x.shape[-1]), weight).view(*lead, weight.shape[0])


def normed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(norm(x + residual) @ weightᵀ, x + residual) in one launch — with no residual (norm(x) @
    weightᵀ, x) — where `chooses_kernel` says so; None elsewhere (the caller norms, then projects)."""
    if not chooses_kernel(x, weight) or norm_weight.dtype != x.dtype:
        return None
    if residual is None:
        return resident_gemv(x, weight, norm=(norm_weight, eps)), x
    return resident_gemv(x, weight, norm=(norm_weight, eps), residual=residual)
