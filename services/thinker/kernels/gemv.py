"""Skinny GEMM in Triton for a decode step's few tokens: y [M, N] = x [M, K] @ W [N, K]ᵀ, M ≤ 16.

At small M a projection only streams its weight, and cuBLAS's small-M kernels reach ~37 % of an
H200's bandwidth on Ling-mini's attention projections (bench/RESULTS.md). Here each program owns
BLOCK_N weight rows and one K range, loads them in wide BLOCK_K tiles (the M rows padded to 16 for
one tensor-core dot per tile, fp32 accumulation) and either writes its rows in the input dtype or,
split over K where the row blocks alone would not fill the SMs, an fp32 partial that a second
launch sums in a fixed order (deterministic, no atomics). Graph-capturable: no host sync, and the
partials come from the allocator like the output does (a graph's private pool on capture).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import dot_precision, interpreting, pdl
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels

# Up to this many tokens the kernel serves (one 16-row dot tile per weight tile); above it the
# weight reads amortise over the tokens and cuBLAS's GEMMs win.
MAX_TOKENS = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK_M = 16
# Programs the default config aims at: two waves of an H200's 132 SMs.
_TARGET_PROGRAMS = 264
# Shared memory the pipelined tiles may take (an H100/H200 block has ~227 KiB): stages are dropped
# until they fit, so an fp32 run (twice the bytes) or a wide sweep config still compiles.
_SMEM_BYTES = 160 * 1024


@dataclass(frozen=True)
class GemvConfig:
    """One launch's tiling: weight rows and columns per tile, K splits, warps, pipeline stages; and
    up to how many tokens the kernel serves the shape (0: never, cuBLAS measured faster)."""

    block_n: int = 32
    block_k: int = 256
    split: int = 1
    warps: int = 4
    stages: int = 4
    max_tokens: int = MAX_TOKENS


# Tuned configs by (N, K) from bench/gemv_gpu.py's sweep (one H200, 2026-11-29, graph-timed; Ling-mini
# TP=1 and Ming-flash TP=2 shapes): `max_tokens` 8 where the kernel beat cuBLAS at 1 and 8 tokens, 1
# where only at 1, 0 where cuBLAS won (bench/RESULTS.md). On a GPU a shape not here goes to cuBLAS;
# under the interpreter (CPU tests) it gets `default_config`.
CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (1024, 2048): GemvConfig(32, 128, 4, 4, 4, 8),  # Ling-mini shared gate/up: 4.1 vs 12.4 µs
    (1024, 4096): GemvConfig(32, 128, 4, 4, 3, 8),  # Ming TP=2 shared gate/up: 5.2 vs 6.1
    (2048, 512): GemvConfig(16, 128, 1, 4, 3, 8),  # Ling-mini shared down: 2.6 vs 3.0
    (2048, 2048): GemvConfig(32, 128, 4, 4, 3, 8),  # Ling-mini o: 4.8 vs 5.0
    (2048, 5120): GemvConfig(64, 256, 4, 4, 4, 8),  # Ling-mini dense down: 6.7 vs 8.6
    (2560, 4096): GemvConfig(32, 128, 4, 4, 3, 1),  # Ming TP=2 qkv: 7.5 vs 8.2 (cuBLAS at 8)
    (3072, 2048): GemvConfig(32, 128, 4, 4, 3, 0),  # Ling-mini qkv: cuBLAS 5.0 vs 5.7
    (4096, 512): GemvConfig(32, 128, 1, 4, 3, 8),  # Ming TP=2 shared down: 2.8 vs 3.2
    (4096, 2048): GemvConfig(64, 128, 4, 4, 3, 0),  # Ming TP=2 o: cuBLAS 5.4 vs 5.8
    (4096, 4608): GemvConfig(64, 128, 4, 4, 4, 8),  # Ming TP=2 dense down: 8.5 vs 11.2
    (9216, 4096): GemvConfig(32, 128, 1, 4, 4, 8),  # Ming TP=2 dense gate/up: 20.9 vs 23.4
    (10240, 2048): GemvConfig(64, 128, 4, 4, 3, 0),  # Ling-mini dense gate/up: cuBLAS 8.9 vs 9.5
    (78592, 4096): GemvConfig(64, 256, 1, 4, 3, 8),  # Ming TP=2 LM head: 143.7 vs 148.2
    (157184, 2048): GemvConfig(64, 128, 1, 4, 4, 8),  # Ling-mini LM head: 142.8 vs 147.3
}


def default_config(n: int, k: int) -> GemvConfig:
    """32 rows a program; split K (in ≥ 2 tiles of 256 each) until ~two waves of programs run."""
    cfg = GemvConfig()
    blocks = triton.cdiv(n, cfg.block_n)
    split = 1
    while blocks * split < _TARGET_PROGRAMS and k // (2 * split * cfg.block_k) >= 2:
        split *= 2
    return replace(cfg, split=split)


def config_for(n: int, k: int) -> GemvConfig:
    """The shape's tuned config; else, on a GPU, one that leaves it to cuBLAS (unmeasured), and under
    the interpreter the default tiling."""
    tuned = CONFIGS.get((n, k))
    if tuned is not None:
        return tuned
    default = default_config(n, k)
    return default if interpreting() else replace(default, max_tokens=0)


def chooses_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The one dispatch rule: this kernel for ≤ MAX_TOKENS rows (fewer where the shape's tuned
    config says cuBLAS wins from there) of a supported dtype (x's and the weight's the same), a
    contiguous 2-D weight, on CUDA (or anywhere under TRITON_INTERPRET=1); F.linear otherwise."""
    rows = x.numel() // max(1, x.shape[-1])
    return (
        0 < rows <= MAX_TOKENS
        and weight.dim() == 2
        and rows <= config_for(weight.shape[0], weight.shape[1]).max_tokens
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[1]
        and (x.is_cuda and weight.is_cuda or interpreting())
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias), through `gemv` where `chooses_kernel` says so."""
    if not chooses_kernel(x, weight):
        return F.linear(x, weight)
    lead = x.shape[:-1]
    return gemv(x.reshape(-1, x.shape[-1]), weight).view(*lead, weight.shape[0])


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ → [M, N] in x's dtype, fp32 accumulation; M ≤ MAX_TOKENS."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or config_for(n, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = max(1, min(cfg.split, triton.cdiv(k, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    partial = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    stages = cfg.stages
    while stages > 1 and stages * (cfg.block_n + _BLOCK_M) * cfg.block_k * x.element_size() > _SMEM_BYTES:
        stages -= 1
    grid = (triton.cdiv(n, cfg.block_n), split)
    _gemv_kernel[grid](
        x,
        weight,
        partial,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PRECISION=dot_precision(x.dtype),
        num_warps=cfg.warps,
        num_stages=stages,
        **pdl.launch(x.device),
    )
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            partial, out, m * n, SPLIT=split, BLOCK=block, **pdl.launch(x.device)
        )
    return out


@triton.jit(do_not_specialize=["m"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    m,
    n,
    k,
    k_per_split,
    stride_x,
    stride_w,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (n, s): rows [n·BLOCK_N, +BLOCK_N) of the output over K range s; its sum into
    out[s] (fp32 partials) or, with one range, out itself in its dtype."""
    wait_for_prior_kernels(USE_PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < n
    k0 = pid_s * k_per_split
    k_end = tl.minimum(k, k0 + k_per_split)
    x_ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k0, k_end, BLOCK_K):
        k_ok = ks < k_end - kk
        xt = tl.load(x_ptrs + kk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs + kk, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
    out_ptrs = out_ptr + pid_s * m * n + rows[:, None] * n + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(
    partial_ptr, out_ptr, count, SPLIT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    """out[i] = Σ_s partial[s, i] in split order (the same sum every replay), cast to out's dtype."""
    wait_for_prior_kernels(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < count
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(partial_ptr + s * count + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)
