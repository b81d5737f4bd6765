"""Routed experts in Triton with no host sync (so a decode step can be a CUDA graph): the pairs laid
out by expert in block-padded runs, then the two GEMMs over those runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import dot_precision


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes of both GEMMs; small-M tiles in decode (memory-bound), larger ones in prefill."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def choose_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """From the average rows an expert gets: a decode batch touches each expert with a few rows."""
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 4:
        return MoeTiles(16, 32, 128, 4, 4)
    if per_expert <= 32:
        return MoeTiles(32, 64, 64, 4, 3)
    return MoeTiles(64, 128, 64, 8, 3)


# Pairs each counting program takes: a decode step's pairs in one program, a prefill's over many.
COUNT_SPAN = 512


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted layout in the worst case: every hit expert's run padded by block_m - 1."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-worst // block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    ids_ptr, counts_ptr, num_pairs, NUM_EXPERTS: tl.constexpr, CHUNK: tl.constexpr, SPAN: tl.constexpr
):
    """Pairs per expert: each program counts SPAN pairs (CHUNK at a time) and adds its counts to the
    zeroed `counts` atomically, so a prefill's tens of thousands of pairs are counted in parallel."""
    experts = tl.arange(0, NUM_EXPERTS)
    counts = tl.zeros((NUM_EXPERTS,), dtype=tl.int32)
    first = tl.program_id(0) * SPAN
    for start in range(first, tl.minimum(first + SPAN, num_pairs), CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=NUM_EXPERTS)
        counts += tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)
    tl.atomic_add(counts_ptr + experts, counts)


@triton.jit
def _runs_kernel(
    counts_ptr, ends_ptr, cursor_ptr, num_rows_ptr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr
):
    """One program: each expert's run padded to whole blocks and laid end to end (`ends`, and the
    run starts as the scatter's cursors), and the rows in use."""
    experts = tl.arange(0, NUM_EXPERTS)
    counts = tl.load(counts_ptr + experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(ends_ptr + experts, ends)
    tl.store(cursor_ptr + experts, ends - padded)
    tl.store(num_rows_ptr, tl.max(ends, axis=0))


@triton.jit
def _scatter_kernel(ids_ptr, pairs_ptr, cursor_ptr):
    """Pair i takes the next row of its expert's run (order within a run does not matter: each
    row's result is computed on its own and written back at its pair index)."""
    i = tl.program_id(0)
    expert = tl.load(ids_ptr + i)
    row = tl.atomic_add(cursor_ptr + expert, 1)
    tl.store(pairs_ptr + row, i)


@triton.jit
def _block_rows(pairs_ptr, counts_ptr, ends_ptr, pid_m, BLOCK_M: tl.constexpr, LOG2_EXPERTS: tl.constexpr):
    """The expert of row block `pid_m` (binary search over the run ends) and the block's pair
    indices, with a mask of the rows that hold one (the rest of a run's last block is padding)."""
    first = pid_m * BLOCK_M
    expert = 0  # ends rise with the expert: count the runs that end at or before `first`
    for i in tl.static_range(LOG2_EXPERTS):
        step = 1 << (LOG2_EXPERTS - 1 - i)
        expert = tl.where(tl.load(ends_ptr + expert + step - 1) <= first, expert + step, expert)
    count = tl.load(counts_ptr + expert)
    run_start = tl.load(ends_ptr + expert) - (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    valid = rows - run_start < count
    pairs = tl.load(pairs_ptr + rows, mask=valid, other=0)
    return expert.to(tl.int64), pairs, valid


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """ids [T, k] → (sorted_pairs [P], counts [E], ends [E], num_rows [1]), all int32.

    sorted_pairs holds pair indices (token * k + slot) grouped by expert, each expert's run starting
    on a block boundary (`ends`: where each padded run ends; rows past a run's count are padding,
    never written); blocks past `num_rows` are skipped by the kernels. P depends only on T, k, E
    and block_m (graph-safe). A zero fill and three launches, no host sync."""
    flat = ids.reshape(-1).to(torch.int32)
    n = flat.numel()
    dev = flat.device
    pairs = torch.empty(max_padded_rows(n, num_experts, block_m), dtype=torch.int32, device=dev)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    ends, cursor = (torch.empty(num_experts, dtype=torch.int32, device=dev) for _ in range(2))
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    _count_kernel[(triton.cdiv(n, COUNT_SPAN),)](
        flat, counts, n, NUM_EXPERTS=num_experts, CHUNK=32, SPAN=COUNT_SPAN
    )
    _runs_kernel[(1,)](counts, ends, cursor, num_rows, NUM_EXPERTS=num_experts, BLOCK_M=block_m)
    _scatter_kernel[(n,)](flat, pairs, cursor)
    return pairs, counts, ends, num_rows


def align_supported(num_experts: int) -> bool:
    """The one-program count and the binary search need a power-of-two expert count."""
    return num_experts > 0 and num_experts & (num_experts - 1) == 0


@triton.jit
def _silu_and_mul(gate_acc, up_acc, dt: tl.constexpr):
    """silu(gate)·up in `dt` with the reference's roundings: gate and up to `dt`, then silu, then the
    product."""
    gate = gate_acc.to(dt).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
    return (act * up_acc.to(dt).to(tl.float32)).to(dt)


@triton.jit
def _expert_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    weight_ptr,
    pairs_ptr,
    counts_ptr,
    ends_ptr,
    num_rows_ptr,
    n_out,
    k_in,
    pairs_per_row,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOG2_EXPERTS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One row block of an expert's run x BLOCK_N columns: out[pair] = a[pair // pairs_per_row] @ w[expert]ᵀ;
    GATED (gate-up): w's first n_out rows the gate, the next n_out the up projection, the result
    silu(gate)·up; else (down): the result weighted by the pair's routing weight."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert, pairs, valid = _block_rows(pairs_ptr, counts_ptr, ends_ptr, pid_m, BLOCK_M, LOG2_EXPERTS)
    rows = tl.where(valid, pairs // pairs_per_row, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_base = w_ptr + expert * stride_we + offs_k[:, None]
    b_ptrs = w_base + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        u_ptrs = w_base + (offs_n[None, :] + n_out) * stride_wn
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = offs_k < k_in - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
            u_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dt = a_ptr.dtype.element_ty
    if GATED:
        result = _silu_and_mul(acc, acc_u, dt)
    else:  # the reference rounds each expert's output to the activation dtype before weighting it
        result = acc.to(dt).to(tl.float32) * tl.load(weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, result, mask=valid[:, None] & n_ok[None, :])


def _expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    layout: tuple[torch.Tensor, ...],
    meta: dict,
    *,
    pairs_per_row: int = 1,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch of `_expert_gemm_kernel` over `align_by_expert`'s layout; gated when no routing
    `weights` are given (w [E, 2N, K]: gate rows then up rows), else w [E, N, K]."""
    gated = weights is None
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    grid = (layout[0].numel() // meta["BLOCK_M"], triton.cdiv(n_out, meta["BLOCK_N"]))
    _expert_gemm_kernel[grid](
        a,
        w,
        out,
        out if gated else weights,
        *layout,
        n_out,
        w.shape[2],
        pairs_per_row,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        GATED=gated,
        **meta,
    )
    return out


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], weights/ids [T, k] → fp32 [T, H]."""
    t, k = ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if t == 0:
        return torch.zeros(0, hidden, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    n = t * k
    tiles = choose_tiles(n, num_experts)
    layout = align_by_expert(ids, num_experts, tiles.block_m)
    meta = dict(
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        LOG2_EXPERTS=num_experts.bit_length() - 1,
        PRECISION=dot_precision(x.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _expert_gemm(x, w13, h, layout, meta, pairs_per_row=k)
    out = torch.empty(n, hidden, dtype=torch.float32, device=x.device)
    _expert_gemm(h, w2, out, layout, meta, weights=weights.reshape(-1).float().contiguous())
    return out.view(t, k, hidden).sum(dim=1)
