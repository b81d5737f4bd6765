"""The routed experts of one token (a decode step of one sequence) in two launches, without the
alignment: the gate-up launch reads the router's expert ids itself, and the down launch reads its
weights before its PDL wait and sums the token's experts and the shared expert in the same launch
(no combine launch). On a GPU the gate-up runs in one wave of programs, each streaming its tiles
with the next tile's reads in flight while it computes the current one: with a program a tile,
Ming-flash's rank took 4.4 waves, each program's reads waiting for one before it to leave its SM.

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

import functools
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
# The gate-up launch streams its tiles of STREAM_ROWS rows in STREAM_PROGRAMS_PER_SM programs an SM
# (one wave; `OneTokenTiles.programs`). One H200, 2026-11-29 (bench/moe_one_token_gpu.py, as above):
# Ming-flash TP=2's rank 41.8 µs a layer (41.3 at 2 programs an SM) against 46.3 with a program a tile
# of 4 rows; Ling-mini 25.1 either way (2 programs an SM 27.4; tiles of 4 rows 25.9-27.7, of 8 rows
# 34.6-38.6: two such tiles in flight spill).
STREAM_ROWS, STREAM_PROGRAMS_PER_SM = 2, 4


@dataclass(frozen=True)
class OneTokenTiles:
    """Rows a program of each launch (gate-up: intermediate columns, of both the gate and the up
    weight; down: hidden rows, of every chosen expert), and their warps; `programs` > 0: the gate-up
    launch in that many programs, each streaming its tiles of `gate_up_rows`
    (`_one_token_gate_up_stream_kernel`), else a program a tile."""

    gate_up_rows: int
    down_rows: int
    warps: int = 4
    programs: int = 0


def default_tiles(
    hidden: int, inter: int, top_k: int, element_size: int, warps: int = 4, sms: int = 0
) -> OneTokenTiles:
    """Down: the most rows (a power of two) whose weights fit `_PROGRAM_BYTES`, (top_k + 1) x rows x
    intermediate (the shared expert's rows besides). Gate-up: with `sms` (the device's SMs) streamed
    in STREAM_PROGRAMS_PER_SM programs an SM, else a program a tile of the most rows whose 2 x rows x
    hidden fit the budget."""
    budget = _PROGRAM_BYTES // element_size

    def rows(per_row: int) -> int:
        n = max(1, budget // per_row)
        return 1 << (n.bit_length() - 1)

    gate_up = STREAM_ROWS if sms > 0 else rows(2 * triton.next_power_of_2(hidden))
    down = rows((top_k + 1) * triton.next_power_of_2(inter))
    return OneTokenTiles(
        min(gate_up, triton.next_power_of_2(inter)),
        min(down, triton.next_power_of_2(hidden)),
        warps,
        STREAM_PROGRAMS_PER_SM * sms,
    )


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs the streaming gate-up spreads over: the CUDA device's, one under the interpreter (so
    the CPU tests run the path the GPU takes, in STREAM_PROGRAMS_PER_SM programs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


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
def _finish_tile(gate_w, up_w, x, t, h_ptr, inter, BLOCK_N: tl.constexpr):
    """silu(gate)·up of tile t (`_tile_weights`' rows times x, fp32 sums) into h[slot] at its columns."""
    blocks = tl.cdiv(inter, BLOCK_N)
    gate = tl.sum(gate_w.to(tl.float32) * x[None, :], axis=1)
    up = tl.sum(up_w.to(tl.float32) * x[None, :], axis=1)
    cols = (t % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = silu_mul(gate, up, h_ptr.dtype.element_ty)
    tl.store(h_ptr + (t // blocks) * inter + cols, h, mask=cols < inter)


@triton.jit
def _tile_weights(
    w13_ptr, shared_ptr, ids_ptr, t, sizes, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, H_PAD: tl.constexpr
):
    """Tile t's gate and up rows [BLOCK_N, H_PAD] (tile t: slot t // blocks -- TOP_K the shared
    expert --, intermediate columns of block t % blocks); zeros past the last tile. `sizes` =
    (inter, hidden, the experts' stride)."""
    inter, hidden, stride_we = sizes
    blocks = tl.cdiv(inter, BLOCK_N)
    slot = t // blocks
    if slot < TOP_K:
        base = w13_ptr + tl.load(ids_ptr + slot) * stride_we
    else:
        base = shared_ptr
    cols = (t % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, H_PAD)
    mask = (cols < tl.where(slot <= TOP_K, inter, 0))[:, None] & (ks < hidden)[None, :]
    rows = cols.to(tl.int64)[:, None] * hidden + ks[None, :]
    return tl.load(base + rows, mask=mask, other=0.0), tl.load(
        base + inter * hidden + rows, mask=mask, other=0.0
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
    """Program (column block, slot): tile slot · blocks + block (`_tile_weights`), silu(gate)·up of
    intermediate columns [n·BLOCK_N, +BLOCK_N) for the token's slot-th expert (slot TOP_K: the
    shared expert) into h[slot]."""
    wait_for_prior_kernels(USE_PDL)
    t = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    gate_w, up_w = _tile_weights(
        w13_ptr, shared_ptr, ids_ptr, t, (inter, hidden, stride_we), TOP_K, BLOCK_N, H_PAD
    )
    ks = tl.arange(0, H_PAD)
    x = tl.load(x_ptr + ks, mask=ks < hidden, other=0.0).to(tl.float32)
    _finish_tile(gate_w, up_w, x, t, h_ptr, inter, BLOCK_N)


@triton.jit
def _one_token_gate_up_stream_kernel(
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
    """The gate-up launch in one wave: program p of P computes tiles p, p + P, ... (`_tile_weights`;
    h[slot] as `_one_token_gate_up_kernel`), the next tile's weights loaded before the current
    tile's products, so each program keeps two tiles' reads in flight and no program waits for
    another to leave its SM."""
    wait_for_prior_kernels(USE_PDL)
    sizes = (inter, hidden, stride_we)
    blocks = tl.cdiv(inter, BLOCK_N)
    ks = tl.arange(0, H_PAD)
    x = tl.load(x_ptr + ks, mask=ks < hidden, other=0.0).to(tl.float32)
    t = tl.program_id(0)
    gate_w, up_w = _tile_weights(w13_ptr, shared_ptr, ids_ptr, t, sizes, TOP_K, BLOCK_N, H_PAD)
    for _ in range(tl.program_id(0), blocks * (TOP_K + 1), tl.num_programs(0)):
        after = t + tl.num_programs(0)
        gate_next, up_next = _tile_weights(w13_ptr, shared_ptr, ids_ptr, after, sizes, TOP_K, BLOCK_N, H_PAD)
        _finish_tile(gate_w, up_w, x, t, h_ptr, inter, BLOCK_N)
        gate_w, up_w, t = gate_next, up_next, after


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


def _gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor,
    h: torch.Tensor,
    tiles: OneTokenTiles,
) -> None:
    """The gate-up launch into h [top_k + 1, I]: a program a tile, or `tiles.programs` streaming."""
    hidden, inter, top_k = x.shape[1], w13.shape[1] // 2, ids.numel()
    args = (x, w13, shared, ids, h, inter, hidden, w13.stride(0))
    shape = dict(TOP_K=top_k, BLOCK_N=tiles.gate_up_rows, H_PAD=triton.next_power_of_2(hidden))
    if tiles.programs > 0:
        _one_token_gate_up_stream_kernel[(tiles.programs,)](
            *args, **shape, num_warps=tiles.warps, num_stages=1, **pdl.launch(x.device)
        )
    else:
        grid = (triton.cdiv(inter, tiles.gate_up_rows), top_k + 1)
        _one_token_gate_up_kernel[grid](*args, **shape, num_warps=tiles.warps, **pdl.launch(x.device))


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
    tiles = tiles or default_tiles(hidden, inter, top_k, x.element_size(), sms=sm_count(x.device))
    x = x.contiguous()
    ids = ids.reshape(-1).contiguous()
    routing = weights.reshape(-1).float().contiguous()
    h = torch.empty(top_k + 1, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    _gate_up(x, w13, ids, shared[0], h, tiles)
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
