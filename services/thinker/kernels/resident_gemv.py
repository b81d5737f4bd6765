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

The qkv projection's q and k heads may be QK-normed and roped in the same launch (`normed_qkv_rope`,
where the attention would otherwise launch `norms.qk_norm_rope` on its own: `rope_epilogue_applies`,
the one rule): once a program has stored its columns, each q or k head it holds part of takes a
ticket (`tickets.py`), and the last of the head's programs to finish reads the head's rows back
past L1 and norms and ropes them in place with the separate launch's helper (`norms.norm_rope_heads`),
so bit for bit as that launch; the step's cos/sin, from the rope gather earlier in the step, and the
norm weights are read after the PDL wait. v heads take no ticket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import interpreting, pdl
from omnistage.services.thinker.kernels.norms import (
    add_residual,
    norm_rope_heads,
    rms_rstd,
    rms_scale,
    sum_of_squares,
)
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels
from omnistage.services.thinker.kernels.tickets import last_to_finish, tickets_for

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


@triton.constexpr_function
def _heads_a_program(block_n, head_dim):
    """The heads a program's BLOCK_N output columns hold part of (both powers of two)."""
    return max(1, block_n // head_dim)


@triton.constexpr_function
def _programs_a_head(block_n, head_dim):
    """The programs that store a head's columns: its ticket's count."""
    return max(1, head_dim // block_n)


@triton.jit
def _qk_rope_epilogue(
    out_ptr,
    m,
    stride_o,
    tickets_ptr,
    rope,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    NORM: tl.constexpr,
):
    """After the program stored its columns of every row: each q or k head it holds part of (heads
    [0, qk_heads), the q heads first) takes a ticket a head (`tickets.last_to_finish`: its
    programs' stores done, the launch's rows in one), and the program that takes the head's last
    QK-norms and ropes the head of each row in place, as `norms.qk_norm_rope`'s program does
    (`norm_rope_heads`, the same [HEAD_DIM] shape) -- reading the rows past L1 (.cg: other programs
    stored them). v heads: nothing. `rope` = (q and k norm weights, cos, sin [m, ROT], cos's row
    stride, q heads, q + k heads, eps); read after the PDL wait (the step's rope gather wrote cos
    and sin, maybe the launch right before)."""
    qw_ptr, kw_ptr, cos_ptr, sin_ptr, stride_c, q_heads, qk_heads, eps = rope
    d = tl.arange(0, HEAD_DIM)
    first = tl.program_id(0) * BLOCK_N // HEAD_DIM
    for i in tl.static_range(_heads_a_program(BLOCK_N, HEAD_DIM)):
        head = first + i
        if head < qk_heads:
            if last_to_finish(tickets_ptr, head, _programs_a_head(BLOCK_N, HEAD_DIM)):
                if head < q_heads:
                    w_ptr = qw_ptr
                else:
                    w_ptr = kw_ptr
                for row in range(m):
                    rows = out_ptr + row * stride_o + head * HEAD_DIM + d
                    cos_row, sin_row = cos_ptr + row * stride_c, sin_ptr + row * stride_c
                    y = norm_rope_heads(rows, d < HEAD_DIM, w_ptr, cos_row, sin_row, eps, ROT, NORM, ".cg")
                    tl.store(rows, y)


@triton.jit(do_not_specialize=["m"])
def _resident_gemv_kernel(
    x_ptr,
    r_ptr,
    norm_w_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    tickets_ptr,
    m,
    n,
    k,
    eps,
    stride_x,
    stride_r,
    stride_w,
    stride_o,
    stride_s,
    stride_c,
    q_heads,
    qk_heads,
    qk_eps,
    BLOCK_N: tl.constexpr,
    K_PAD: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    QK_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program n: output columns [n·BLOCK_N, +BLOCK_N) of every row. Its weight rows (and the norm
    weight) are loaded before the wait: static operands (pdl.STATIC_OPERANDS), never written by a
    kernel. NORM: the row is weight * norm(x (+ residual)) first, `norms.rms_norm`'s row bit for bit
    (its helpers). ROT > 0: then the output's q and k heads (HEAD_DIM columns each) QK-normed
    (QK_NORM) and roped in place (`_qk_rope_epilogue`); else qw .. tickets, stride_c, the heads and
    qk_eps are unread."""
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
    if ROT > 0:
        rope = (qw_ptr, kw_ptr, cos_ptr, sin_ptr, stride_c, q_heads, qk_heads, qk_eps)
        _qk_rope_epilogue(out_ptr, m, stride_o, tickets_ptr, rope, BLOCK_N, HEAD_DIM, ROT, QK_NORM)


# A qkv projection's heads and their QK-norm + rope, the epilogue's operand: ((q heads, KV heads, head
# dim) of the output's [q | k | v] columns, (q norm weight, k norm weight (both or neither: no norm),
# eps, cos, sin [M, rotary dim])) -- the second in the order `norms.qk_norm_rope` takes it.
QKRope = tuple[tuple[int, int, int], tuple]


def resident_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    config: ResidentConfig | None = None,
    rope: QKRope | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] @ weight [N, K]ᵀ → [M, N] in x's dtype (M ≤ MAX_TOKENS). `norm` = (norm weight [K],
    eps): of norm(x) instead, and with `residual` of norm(x + residual), returning (y, x + residual)
    as `norms.rms_norm` returns its sum. `rope` (`QKRope`): then y's q and k heads QK-normed and
    roped in place in the same launch, `norms.qk_norm_rope` on y's views bit for bit (its helper;
    `rope_shape_ok`'s shapes, else ValueError)."""
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
    rope_pointers, rope_scalars, rope_constants = _epilogue_operands(out, rope)
    if m:
        _resident_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x,
            r,
            norm_w,
            weight,
            out,
            total,
            *rope_pointers,
            m,
            n,
            k,
            eps,
            x.stride(0),
            r.stride(0),
            weight.stride(0),
            out.stride(0),
            total.stride(0),
            *rope_scalars,
            BLOCK_N=cfg.block_n,
            K_PAD=triton.next_power_of_2(k),
            NORM=norm is not None,
            RESIDUAL=residual is not None,
            **rope_constants,
            num_warps=cfg.warps,
            **pdl.launch(x.device),
        )
    return out if residual is None else (out, total)


def rope_shape_ok(rows: int, n: int, rope: QKRope) -> bool:
    """Whether the epilogue takes `rope` on an output [rows, n]: n = (q heads + 2 KV heads) x head
    dim, the head dim a power of two (a program's columns then lie in one head, or hold whole
    heads), the rotary dim even in (0, head dim], cos and sin [rows, rotary dim], the norm weights
    both or neither, each [head dim] and contiguous."""
    (q_heads, kv_heads, head_dim), (q_w, k_w, _, cos, sin) = rope
    rot = cos.shape[-1]
    if (q_w is None) != (k_w is None):
        return False
    weights_ok = q_w is None or (
        q_w.shape == k_w.shape == (head_dim,) and q_w.is_contiguous() and k_w.is_contiguous()
    )
    return (
        weights_ok
        and q_heads > 0
        and kv_heads > 0
        and head_dim > 0
        and head_dim & (head_dim - 1) == 0
        and n == (q_heads + 2 * kv_heads) * head_dim
        and rot % 2 == 0
        and 0 < rot <= head_dim
        and tuple(cos.shape) == tuple(sin.shape) == (rows, rot)
    )


def _epilogue_operands(out: torch.Tensor, rope: QKRope | None) -> tuple[tuple, tuple, dict]:
    """The launch's epilogue operands: pointers (q and k norm weights, cos, sin, tickets), scalars
    (cos's row stride, the q heads, the q + k heads, eps) and constants (HEAD_DIM, ROT, QK_NORM):
    `rope`'s, checked, or stand-ins the kernel never reads and ROT 0 without it."""
    if rope is None:
        return (out,) * 5, (0, 0, 0, 0.0), {"HEAD_DIM": 0, "ROT": 0, "QK_NORM": False}
    if not rope_shape_ok(out.shape[0], out.shape[1], rope):
        raise ValueError("resident_gemv: the QK-norm + rope epilogue does not take these shapes")
    (q_heads, kv_heads, head_dim), (q_w, k_w, eps, cos, sin) = rope
    cos, sin = cos.contiguous(), sin.contiguous()
    norm = q_w is not None
    tickets = tickets_for(out.device, q_heads + kv_heads)
    pointers = (q_w if norm else cos, k_w if norm else cos, cos, sin, tickets)
    constants = {"HEAD_DIM": head_dim, "ROT": cos.shape[-1], "QK_NORM": norm}
    return pointers, (cos.stride(0), q_heads, q_heads + kv_heads, eps), constants


def linear(x: torch.Tensor, weight: torch.Tensor, fallback: Callable | None = None) -> torch.Tensor:
    """F.linear(x, weight) (no bias) through `resident_gemv` where `chooses_kernel` says so, else
    through `fallback` (the tiled GEMV's dispatch, when on) or F.linear."""
    if not chooses_kernel(x, weight):
        return (fallback or F.linear)(x, weight)
    lead = x.shape[:-1]
    return resident_gemv(x.reshape(-1, x.shape[-1]), weight).view(*lead, weight.shape[0])


def serves_normed(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """`normed_linear`'s rule: `chooses_kernel`, and a norm weight in x's dtype."""
    return chooses_kernel(x, weight) and norm_weight.dtype == x.dtype


def normed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(norm(x + residual) @ weightᵀ, x + residual) in one launch — with no residual (norm(x) @
    weightᵀ, x) — where `serves_normed` says so; None elsewhere (the caller norms, then projects)."""
    if not serves_normed(x, weight, norm_weight):
        return None
    if residual is None:
        return resident_gemv(x, weight, norm=(norm_weight, eps)), x
    return resident_gemv(x, weight, norm=(norm_weight, eps), residual=residual)


def rope_epilogue_applies(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, rope: QKRope, apart: bool
) -> bool:
    """The one dispatch rule of the qkv projection's QK-norm + rope epilogue (`normed_qkv_rope`):
    the attention would apply QK-norm + rope in a launch of its own this step (`apart`: not folded
    into its decode launch, `paged_attention.folds_qk_rope`; `PagedAttention.qk_rope_apart`), this
    kernel serves the add + norm + projection (`serves_normed`: one or two tokens, a weight that
    fits), and the epilogue takes the shapes (`rope_shape_ok`)."""
    rows = x.numel() // max(1, x.shape[-1])
    return apart and serves_normed(x, weight, norm_weight) and rope_shape_ok(rows, weight.shape[0], rope)


def normed_qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    rope: QKRope,
    apart: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`normed_linear` with the q and k heads of its output QK-normed and roped in the same launch
    (`rope`: `QKRope`) -- `normed_linear`, then `norms.qk_norm_rope` in place on the q and k views,
    bit for bit, one launch fewer -- where `rope_epilogue_applies` says so; None elsewhere."""
    if not rope_epilogue_applies(x, weight, norm_weight, rope, apart):
        return None
    if residual is None:
        return resident_gemv(x, weight, norm=(norm_weight, eps), rope=rope), x
    return resident_gemv(x, weight, norm=(norm_weight, eps), residual=residual, rope=rope)
