"""The routed experts of one token (a decode step of one sequence) in two launches, without the
alignment: the gate-up launch reads the router's expert ids itself, and the down launch reads its
weights before its PDL wait and sums the token's experts and the shared expert in the same launch
(no combine launch).

The down launch may read before its wait what no kernel writes (the weights, `pdl.STATIC_OPERANDS`)
and what the launch two back wrote (the router's ids and weights, `pdl.SETTLED_OPERANDS`): the
kernel before it, the gate-up, waits for the router to complete before it lets the down launch
start. So the down weights of the chosen experts stream while the gate-up runs. Each program holds
its rows of every chosen expert's down weight in registers (a whole row: K is the intermediate
size); products and sums in fp32 on CUDA cores (one row: no tensor-core tile to fill), the
roundings the reference makes (each expert's output in the activation dtype, times its routing
weight in fp32, the sum rounded, then the shared expert's output added and rounded again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import interpreting, pdl
from omnistage.services.thinker.kernels.norms import silu_mul
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Weight bytes a program holds in registers. One H200, 2026-11-29 (bench/moe_one_token_gpu.py, router +
# experts graph-timed, µs a layer): Ling-mini 25.6 at gate-up 8 rows (64 KiB) / down 4 rows (36 KiB),
# 4 warps, against 29.0 at 4 / 2 and 31.7 for the aligned path; Ming-flash TP=2's rank 42-47 at 2-8 /
# 4 rows against 50.2 aligned.
_PROGRAM_BYTES = 64 * 1024


@dataclass(frozen=True)
class OneTokenTiles:
    """Rows a program of each launch (gate-up: intermediate columns, of both the gate and the up
    weight; down: hidden rows, of every chosen expert), and their warps."""

    gate_up_rows: int
    down_rows: int
    warps: int = 4


def default_tiles(hidden: int, inter: int, top_k: int, element_size: int, warps: int = 4) -> OneTokenTiles:
    """The most rows (a power of two) whose weights fit `_PROGRAM_BYTES`: gate-up holds 2 x rows x
    hidden, down (top_k + 1) x rows x intermediate (the shared expert's rows besides)."""
    budget = _PROGRAM_BYTES // element_size

    def rows(per_row: int) -> int:
        n = max(1, budget // per_row)
        return 1 << (n.bit_length() - 1)

    gate_up = rows(2 * triton.next_power_of_2(hidden))
    down = rows((top_k + 1) * triton.next_power_of_2(inter))
    return OneTokenTiles(
        min(gate_up, triton.next_power_of_2(inter)), min(down, triton.next_power_of_2(hidden)), warps
    )


def supported(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, shared: tuple | None
) -> bool:
    """The one dispatch rule: one token, a power-of-two top-k, a shared expert of an expert's shape,
    one dtype, contiguous weights, on CUDA (or under TRITON_INTERPRET=1)."""
    if shared is None or x.shape[0] != 1 or ids.shape[0] != 1:
        return False
    top_k = ids.shape[1]
    gate_up, down = shared
    return (
        top_k & (top_k - 1) == 0
        and x.dtype in DTYPES
        and w13.dtype == w2.dtype == gate_up.dtype == down.dtype == x.dtype
        and gate_up.shape == w13.shape[1:]
        and down.shape == w2.shape[1:]
        and all(t.is_contiguous() for t in (w13, w2, gate_up, down))
        and (x.is_cuda or interpreting())
    )


@triton.jit
def _one_token_gate_up_kernel(
    x_ptr,
    w13_ptr,
    shared_ptr,
    ids_ptr,
    h_ptr,
    inter,
    hidden,
    stride_we,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    H_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (column block, slot): silu(gate)·up of intermediate columns [n·BLOCK_N, +BLOCK_N) for
    the token's slot-th expert (slot TOP_K: the shared expert) into h[slot]."""
    wait_for_prior_kernels(USE_PDL)
    slot = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, H_PAD)
    c_ok, k_ok = cols < inter, ks < hidden
    if slot < TOP_K:
        base = w13_ptr + tl.load(ids_ptr + slot) * stride_we
    else:
        base = shared_ptr
    rows = cols.to(tl.int64)[:, None] * hidden + ks[None, :]
    mask = c_ok[:, None] & k_ok[None, :]
    gate_w = tl.load(base + rows, mask=mask, other=0.0)
    up_w = tl.load(base + inter * hidden + rows, mask=mask, other=0.0)
    x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    gate = tl.sum(gate_w.to(tl.float32) * x[None, :], axis=1)
    up = tl.sum(up_w.to(tl.float32) * x[None, :], axis=1)
    h = silu_mul(gate, up, h_ptr.dtype.element_ty)
    tl.store(h_ptr + slot * inter + cols, h, mask=c_ok)


@triton.jit
def _one_token_down_kernel(
    h_ptr,
    w2_ptr,
    shared_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    hidden,
    inter,
    stride_we,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    I_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program n: hidden rows [n·BLOCK_N, +BLOCK_N) of the token's output, Σ_slot round(expert_slot's
    down(h[slot])) · weight_slot in fp32, rounded, + round(shared down(h[TOP_K])), rounded. The
    chosen experts' weight rows (and the routing weights) are read before the wait."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, I_PAD)
    slots = tl.arange(0, TOP_K)
    c_ok, k_ok = cols < hidden, ks < inter
    experts = tl.load(ids_ptr + slots, cache_modifier=".cg")  # the router's, two launches back
    rows = cols.to(tl.int64)[:, None] * inter + ks[None, :]
    mask = c_ok[:, None] & k_ok[None, :]
    w = tl.load(
        w2_ptr + experts[:, None, None] * stride_we + rows[None, :, :], mask=mask[None, :, :], other=0.0
    )
    w_shared = tl.load(shared_ptr + rows, mask=mask, other=0.0)
    route = tl.load(weights_ptr + slots, cache_modifier=".cg")
    wait_for_prior_kernels(USE_PDL)
    dt = out_ptr.dtype.element_ty
    h = tl.load(h_ptr + slots[:, None] * inter + ks[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
    expert_out = tl.sum(w.to(tl.float32) * h[:, None, :], axis=2)  # [TOP_K, BLOCK_N]
    mix = tl.sum(expert_out.to(dt).to(tl.float32) * route[:, None], axis=0).to(dt)
    h_shared = tl.load(h_ptr + TOP_K * inter + ks, mask=k_ok, other=0.0).to(tl.float32)
    shared_out = tl.sum(w_shared.to(tl.float32) * h_shared[None, :], axis=1).to(dt)
    y = (mix.to(tl.float32) + shared_out.to(tl.float32)).to(dt)
    tl.store(out_ptr + cols, y, mask=c_ok)


def one_token_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor],
    tiles: OneTokenTiles | None = None,
) -> torch.Tensor:
    """x [1, H], w13 [E, 2I, H], w2 [E, H, I], the router's fp32 weights and ids [1, k], the shared
    expert's (gate_up [2I, H], down [H, I]) → [1, H] in x's dtype, as `fused_moe.fused_experts`."""
    _, hidden = x.shape
    inter, top_k = w13.shape[1] // 2, ids.shape[1]
    tiles = tiles or default_tiles(hidden, inter, top_k, x.element_size())
    x = x.contiguous()
    ids = ids.reshape(-1).contiguous()
    routing = weights.reshape(-1).float().contiguous()
    h = torch.empty(top_k + 1, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    _one_token_gate_up_kernel[(triton.cdiv(inter, tiles.gate_up_rows), top_k + 1)](
        x,
        w13,
        shared[0],
        ids,
        h,
        inter,
        hidden,
        w13.stride(0),
        TOP_K=top_k,
        BLOCK_N=tiles.gate_up_rows,
        H_PAD=triton.next_power_of_2(hidden),
        num_warps=tiles.warps,
        **pdl.launch(x.device),
    )
    _one_token_down_kernel[(triton.cdiv(hidden, tiles.down_rows),)](
        h,
        w2,
        shared[1],
        ids,
        routing,
        out,
        hidden,
        inter,
        w2.stride(0),
        TOP_K=top_k,
        BLOCK_N=tiles.down_rows,
        I_PAD=triton.next_power_of_2(inter),
        num_warps=tiles.warps,
        **pdl.launch(x.device),
    )
    return out
