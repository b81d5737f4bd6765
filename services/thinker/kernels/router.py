"""The sigmoid group-limited top-k router in Triton: the gate GEMM and the selection in one launch
for a decode batch, the same kernel's selection alone over cuBLAS logits for a prefill, and at one
token its logits alone for a gate-up launch that selects (`normed_logits`, gate_up_select.py).

The reference (`layers/moe.py` Router) takes ~15 launches, and its fp32 GEMV two more copies (the
activations and the gate weight cast to fp32 every step). The fused kernel reads both in their own
dtype and accumulates in fp32, as the reference's fp32 GEMV does: by ROUTE_TABLE's rows, with
CUDA-core products for the fewest tokens, then as tiled tensor-core dots (bf16 x bf16 products are
exact in fp32, so both equal the fp32 GEMV up to the order of the sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import dot_precision, pdl
from omnistage.services.thinker.kernels.norms import add_residual, rms_rstd, rms_scale, sum_of_squares
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels
from omnistage.services.thinker.kernels.route_select import expert_grid, select_experts
from omnistage.services.thinker.kernels.tickets import last_to_finish, tickets_for

# A decode batch's launch by its token count: (up to this many tokens, path, token rows a program).
# One H200, 2026-11-29 (bench/moe_decode_gpu.py, Ling-mini's gate, graph-timed µs a call): the gemv
# path with all T tokens in one block 5.45 (T=1), 6.56 (2), 9.96 (4), 20.65 (8), 33.3 (16) -- its one
# selecting program walks every token and each program's hidden chunk shrinks --; in blocks of one
# token (each block's tokens selected by its own last program, in parallel) 5.67 (2), 6.32 (4), 7.35
# (8), 10.0 (16), of two 8.86 (16); the dot path 9.7-10.5 at every T up to 64, the cuBLAS path 11-20
# (an fp32 SIMT sgemm, split-K reduce and two casts). Unmeasured above 64 tokens; past the last row
# (a prefill) `cublas`.
# A token block of two is never launched: on the H200 (Triton 3.6) the gemv path with blocks of two
# picked duplicate experts for every token (agreement with the reference 0 %, every other block size
# 100 %; bench/RESULTS.md 2026-11-29, session 2) -- since the fused router landed, a decode step of
# exactly two sequences was routed wrongly. `_block_t` turns a block of two into blocks of one.
ROUTE_TABLE: tuple[tuple[int, str, int], ...] = ((8, "gemv", 1), (256, "dot", 16))
# The dtypes the tiled path multiplies (x's and the gate weight's the same); others go to cuBLAS.
DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Products each fused program holds at once (BLOCK_T x BLOCK_E x BLOCK_H fp32): the hidden chunk
# shrinks as the token block grows, so the registers stay bounded.
_TILE_ELEMS = 8192


@dataclass(frozen=True)
class GemvTiles:
    """The gemv path's launch: experts a program at most (`gemv_block_e`: fewer where the token
    rows' whole hidden row would not be one chunk) and warps a program."""

    block_e: int = 4
    warps: int = 4


# The gemv path's tiling. One H200, 2026-11-29 (bench/router_one_token_gpu.py, one token, µs a layer
# of router + experts): Ling-mini (hidden 2048) best at 4 experts, 4 warps (25.3; 1-2 warps 25.7-29.8,
# 8 experts 26.8-28.8); Ming-flash TP=2's rank (hidden 4096) 43.0 at 4 experts (two hidden chunks)
# against 41.5 at 2 (one): so a program takes a whole row in one chunk where it can.
GEMV_TILES = GemvTiles()


def gemv_block_e(rows: int, hidden: int, num_experts: int) -> int:
    """Experts a program on the gemv path: GEMV_TILES.block_e, halved while `rows` tokens' whole
    hidden row times them would pass _TILE_ELEMS products (so the row is read in one chunk)."""
    block_e = min(GEMV_TILES.block_e, num_experts)
    while block_e > 1 and rows * block_e * triton.next_power_of_2(hidden) > _TILE_ELEMS:
        block_e //= 2
    return block_e


# Up to this many tokens a MoE layer's add + RMSNorm runs in its router's launch (`normed_route`): on
# the gemv path each program (a token block of one) reads its token's whole row anyway. One launch
# fewer a MoE layer (issue 40); unmeasured past two.
NORM_MAX_TOKENS = 2


@dataclass(frozen=True)
class RouterTiles:
    """The tiled gate GEMM's launch: experts a program (the dot's N), hidden a dot (K), hidden
    splits (programs per expert block; the last to finish sums them in split order), warps and
    pipeline stages."""

    block_e: int = 32
    block_k: int = 128
    split: int = 4
    warps: int = 4
    stages: int = 3


# The default tiling until bench/moe_decode_gpu.py's sweep measures one (unmeasured: 8 expert blocks
# x 4 splits = 32 programs a token block at 256 experts, 512 of Ling-mini's hidden each).
DOT_TILES = RouterTiles()


@triton.jit
def _w_chunk(experts, h0, stride_w, BLOCK_H: tl.constexpr):
    """The offsets of the experts' gate rows over hidden [h0, h0 + BLOCK_H) (the gemv path's chunk;
    no pointer: the kernel loads its first chunk itself, before the PDL wait)."""
    return experts[:, None] * stride_w + h0 + tl.arange(0, BLOCK_H)[None, :]


@triton.jit
def _chunk_at(rows, h0, stride, BLOCK_H: tl.constexpr):
    """The offsets [len(rows), BLOCK_H] of the rows' hidden chunk [h0, h0 + BLOCK_H)."""
    return rows[:, None] * stride + h0 + tl.arange(0, BLOCK_H)[None, :]


@triton.jit
def _chunk_ok(row_ok, h0, k_hi, BLOCK_H: tl.constexpr):
    """Its mask: the rows `row_ok`, the hidden columns below k_hi."""
    return row_ok[:, None] & (tl.arange(0, BLOCK_H) < k_hi - h0)[None, :]


@triton.jit
def _load_chunk(ptr, rows, row_ok, h0, k_hi, stride, BLOCK_H: tl.constexpr):
    """The rows' chunk at `ptr` over hidden [h0, min(h0 + BLOCK_H, k_hi)), zeros elsewhere."""
    ok = _chunk_ok(row_ok, h0, k_hi, BLOCK_H)
    return tl.load(ptr + _chunk_at(rows, h0, stride, BLOCK_H), mask=ok, other=0.0)


@triton.jit
def _x_times_w(x, w):
    """[len(rows), len(experts)] fp32 sums over one hidden chunk of the rows' activations `x`
    [rows, BLOCK_H] times the experts' gate rows `w` [experts, BLOCK_H] (each in its own dtype)."""
    return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _gate_gemv(
    x_ptr, w_ptr, w_first, rows, row_ok, experts, k_lo, k_hi, stride_x, stride_w, BLOCK_H: tl.constexpr
):
    """[len(rows), len(experts)] fp32 logits over hidden [k_lo, k_hi): the rows' activations times
    the experts' gate rows, both loaded in their own dtype, products and sums in fp32 on CUDA cores
    (a token or four: no tensor-core tile to fill), chunk by chunk in order; the first chunk of
    the gate rows is `w_first` (loaded before the PDL wait)."""
    acc = _x_times_w(_load_chunk(x_ptr, rows, row_ok, k_lo, k_hi, stride_x, BLOCK_H), w_first)
    for h0 in range(k_lo + BLOCK_H, k_hi, BLOCK_H):
        h_ok = tl.arange(0, BLOCK_H) < k_hi - h0
        w = tl.load(w_ptr + _w_chunk(experts, h0, stride_w, BLOCK_H), mask=h_ok[None, :], other=0.0)
        acc += _x_times_w(_load_chunk(x_ptr, rows, row_ok, h0, k_hi, stride_x, BLOCK_H), w)
    return acc


@triton.jit
def _residual_sum(x_ptr, r_ptr, rows, row_ok, h0, hidden, stride_x, BLOCK_H: tl.constexpr):
    """The rows' chunk at h0 of x + residual (r contiguous) in x's dtype (`norms.add_residual`)."""
    x = _load_chunk(x_ptr, rows, row_ok, h0, hidden, stride_x, BLOCK_H)
    return add_residual(x, _load_chunk(r_ptr, rows, row_ok, h0, hidden, hidden, BLOCK_H))


@triton.jit
def _store_chunk(out_ptr, values, rows, stored, h0, hidden, BLOCK_H: tl.constexpr):
    """`values`, the rows' chunk at h0, into out [T, hidden] (contiguous) for the rows `stored`."""
    ok = _chunk_ok(stored, h0, hidden, BLOCK_H)
    tl.store(out_ptr + _chunk_at(rows, h0, hidden, BLOCK_H), values, mask=ok)


@triton.jit
def _normed_gate_gemv(
    x_ptr, w_ptr, w_first, fold, rows, row_ok, experts, hidden, stride_x, stride_w, BLOCK_H: tl.constexpr
):
    """`_gate_gemv`'s logits of the rows' weight * norm(x + residual) (the add + RMSNorm before the
    router, `norms.rms_norm`'s row bit for bit: its helpers) over the whole hidden row (one split):
    first the residual sum chunk by chunk and its fp64 sum of squares (exact: the chunks' order
    does not matter), then each chunk normed and times the gate rows. `fold` = (the residual, the
    norm weight, its first chunk -- loaded before the PDL wait, as `w_first` --, eps, and where
    the rows `stored` go: normed, sum [T, hidden], for the experts and the layers after)."""
    r_ptr, norm_w_ptr, norm_w_first, eps, normed_ptr, sum_ptr, stored = fold
    first = _residual_sum(x_ptr, r_ptr, rows, row_ok, 0, hidden, stride_x, BLOCK_H)
    _store_chunk(sum_ptr, first, rows, stored, 0, hidden, BLOCK_H)
    squares = sum_of_squares(first, 1)
    for h0 in range(BLOCK_H, hidden, BLOCK_H):
        s = _residual_sum(x_ptr, r_ptr, rows, row_ok, h0, hidden, stride_x, BLOCK_H)
        _store_chunk(sum_ptr, s, rows, stored, h0, hidden, BLOCK_H)
        squares += sum_of_squares(s, 1)
    rstd = rms_rstd(squares, hidden, eps)[:, None]
    dt = x_ptr.dtype.element_ty
    x = rms_scale(first, rstd, norm_w_first[None, :], dt)
    _store_chunk(normed_ptr, x, rows, stored, 0, hidden, BLOCK_H)
    acc = _x_times_w(x, w_first)
    for h0 in range(BLOCK_H, hidden, BLOCK_H):
        h_ok = tl.arange(0, BLOCK_H) < hidden - h0
        w = tl.load(w_ptr + _w_chunk(experts, h0, stride_w, BLOCK_H), mask=h_ok[None, :], other=0.0)
        norm_w = tl.load(norm_w_ptr + h0 + tl.arange(0, BLOCK_H), mask=h_ok, other=0.0)
        s = _residual_sum(x_ptr, r_ptr, rows, row_ok, h0, hidden, stride_x, BLOCK_H)
        x = rms_scale(s, rstd, norm_w[None, :], dt)
        _store_chunk(normed_ptr, x, rows, stored, h0, hidden, BLOCK_H)
        acc += _x_times_w(x, w)
    return acc


@triton.jit
def _gate_dot(
    x_ptr,
    w_ptr,
    rows,
    row_ok,
    experts,
    k_lo,
    k_hi,
    stride_x,
    stride_w,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The same logits as tensor-core dots of [rows, BLOCK_K] x [BLOCK_K, experts] tiles in the
    inputs' dtype, accumulated in fp32 (`PRECISION` ieee for fp32 inputs: exact products too)."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((row_ok.shape[0], experts.shape[0]), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = ks < k_hi - k0
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + k0 + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + experts[None, :] * stride_w + k0 + ks[:, None], mask=k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _sum_splits(
    partial_ptr, logits_ptr, rows, row_ok, num_tokens, NUM_EXPERTS: tl.constexpr, SPLIT: tl.constexpr
):
    """The rows' logits = their SPLIT partial sums added in split order (the same sum every
    launch), read past L1 (.cg: other programs wrote them)."""
    e = tl.arange(0, NUM_EXPERTS)
    at = rows[:, None] * NUM_EXPERTS + e[None, :]
    total = tl.zeros((row_ok.shape[0], NUM_EXPERTS), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        part = partial_ptr + s * num_tokens * NUM_EXPERTS + at
        total += tl.load(part, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
    tl.store(logits_ptr + at, total, mask=row_ok[:, None])


@triton.jit
def _split_range(hidden, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (e, t, s)'s hidden range [k_lo, k_hi): split s of SPLIT whole BLOCK_H steps."""
    chunk = tl.cdiv(tl.cdiv(hidden, SPLIT), BLOCK_H) * BLOCK_H
    k_lo = tl.program_id(2) * chunk
    return k_lo, tl.minimum(hidden, k_lo + chunk)


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    logits_ptr,
    partial_ptr,
    tickets_ptr,
    weights_ptr,
    ids_ptr,
    r_ptr,
    norm_w_ptr,
    normed_ptr,
    sum_ptr,
    num_tokens,
    hidden,
    stride_x,
    stride_w,
    scaling,
    eps,
    NUM_EXPERTS: tl.constexpr,
    GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GEMV: tl.constexpr,
    DOT: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    NORM: tl.constexpr,
    SELECT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (e, t, s) for BLOCK_T tokens. GEMV: the fp32 logits of BLOCK_E experts over hidden
    split s (CUDA-core products, or tensor-core dots when DOT) into `partial` (`logits` when SPLIT
    is 1); the last program of a token block to finish (`tickets.last_to_finish`) sums the splits and
    selects the experts of its tokens from all logits. Else the logits [T, E] are given (x, partial
    and the tickets unread) and program (0, t, 0) selects.
    NORM (gemv, one split): the router's input is weight * norm(x + residual), which program
    (0, t, 0) stores with the sum (`_normed_gate_gemv`); else r, norm_w, normed and sum are unread.
    Before the PDL wait only the static operands are read (pdl.STATIC_OPERANDS, which no kernel
    writes): every program's bias, and on the gemv path its first chunk of gate rows (and of the
    norm weight), load while the previous kernel runs. Not SELECT (gemv, one split): the logits
    only (`normed_logits`; the gate-up after it selects), no ticket, weights and ids unwritten."""
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    k_lo, k_hi = _split_range(hidden, SPLIT, BLOCK_H)
    bias = tl.load(bias_ptr + expert_grid(NUM_EXPERTS, GROUPS)).to(tl.float32)
    if GEMV and not DOT:
        w_first = tl.load(
            w_ptr + _w_chunk(experts, k_lo, stride_w, BLOCK_H),
            mask=(tl.arange(0, BLOCK_H) < k_hi - k_lo)[None, :],
            other=0.0,
        )
        if NORM:
            norm_w_first = tl.load(
                norm_w_ptr + tl.arange(0, BLOCK_H), mask=tl.arange(0, BLOCK_H) < hidden, other=0.0
            )
    wait_for_prior_kernels(USE_PDL)
    pid_t = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    row_ok = rows < num_tokens
    last = True
    if GEMV:
        if DOT:
            acc = _gate_dot(
                x_ptr, w_ptr, rows, row_ok, experts, k_lo, k_hi, stride_x, stride_w, BLOCK_H, PRECISION
            )
        elif NORM:
            stored = rows < tl.where(tl.program_id(0) == 0, num_tokens, 0)  # program (0, t, 0) stores
            fold = (r_ptr, norm_w_ptr, norm_w_first, eps, normed_ptr, sum_ptr, stored)
            acc = _normed_gate_gemv(
                x_ptr, w_ptr, w_first, fold, rows, row_ok, experts, hidden, stride_x, stride_w, BLOCK_H
            )
        else:
            acc = _gate_gemv(
                x_ptr, w_ptr, w_first, rows, row_ok, experts, k_lo, k_hi, stride_x, stride_w, BLOCK_H
            )
        part = partial_ptr + tl.program_id(2) * num_tokens * NUM_EXPERTS
        tl.store(part + rows[:, None] * NUM_EXPERTS + experts[None, :], acc, mask=row_ok[:, None])
        if SELECT:
            last = last_to_finish(tickets_ptr, pid_t, tl.num_programs(0) * tl.num_programs(2))
        else:
            last = False
        if last and SPLIT > 1:
            _sum_splits(partial_ptr, logits_ptr, rows, row_ok, num_tokens, NUM_EXPERTS, SPLIT)
            tl.debug_barrier()  # the summed logits stored before the selection reads them
    if last:
        w, chosen = select_experts(
            logits_ptr + rows * NUM_EXPERTS, bias, row_ok, NUM_EXPERTS, GROUPS, TOPK_GROUP, TOP_K
        )
        out = rows[:, None] * TOP_K + tl.arange(0, TOP_K)[None, :]
        tl.store(weights_ptr + out, w * scaling, mask=row_ok[:, None])
        tl.store(ids_ptr + out, chosen, mask=row_ok[:, None])


PATHS = ("gemv", "dot", "cublas")


def _table_row(t: int) -> tuple[int, str, int] | None:
    """ROUTE_TABLE's row for t tokens (the first that covers them); None past the last."""
    return next((row for row in ROUTE_TABLE if t <= row[0]), None)


def route_path(x: torch.Tensor, weight: torch.Tensor, fuse: bool = True) -> str:
    """The one dispatch rule: ROUTE_TABLE's path for x's token count -- `gemv` (CUDA-core products
    in the selecting launch) or `dot` (tensor-core tiles, same launch; only when x and the gate
    weight share a DOT_DTYPES dtype) --, else `cublas` (the reference's fp32 GEMM, then the
    select-only launch); `cublas` always when not `fuse` (the unfused same-build comparison)."""
    row = _table_row(x.shape[0])
    if not fuse or row is None:
        return "cublas"
    if row[1] == "dot" and not (x.dtype == weight.dtype and x.dtype in DOT_DTYPES):
        return "cublas"
    return row[1]


def _block_t(path: str, t: int, block_t: int | None) -> int:
    """The launch's token rows a program: `block_t` when given, else ROUTE_TABLE's for t on its
    path (the gemv path's capped at t's power of two), else every token in one block (the gemv
    path forced past its rows; at most 16) or 16 (the dot path's tensor-core M)."""
    row = _table_row(t)
    if block_t is None:
        block_t = row[2] if row is not None and row[1] == path else 16
    if path != "gemv":
        return block_t
    block_t = min(block_t, triton.next_power_of_2(t))
    return 1 if block_t == 2 else block_t  # see ROUTE_TABLE: a block of two miscompiles on sm_90


def _tiling(
    path: str, t: int, hidden: int, num_experts: int, tiles: RouterTiles | None, block_t: int | None
) -> tuple[int, int, int, int, int, int]:
    """The launch's (token rows a program, experts a program, hidden a step, splits, warps,
    stages): the dot path's from `tiles` (default DOT_TILES); the gemv path's products bounded by
    _TILE_ELEMS; the select-only path a program a token."""
    if path == "dot":
        cfg = tiles or DOT_TILES
        split = max(1, min(cfg.split, triton.cdiv(hidden, cfg.block_k)))
        rows = _block_t(path, t, block_t)
        return rows, min(cfg.block_e, num_experts), cfg.block_k, split, cfg.warps, cfg.stages
    if path == "gemv":
        rows = _block_t(path, t, block_t)
        block_e = gemv_block_e(rows, hidden, num_experts)
        block_h = max(16, min(triton.next_power_of_2(hidden), _TILE_ELEMS // (rows * block_e)))
        return rows, block_e, block_h, 1, GEMV_TILES.warps, 3
    return 1, num_experts, 16, 1, 4, 3


def _operands(gemm: bool, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The launch's x, w and fp32 logits: on a GEMM path the inputs as they are and an empty
    scratch; else the reference's fp32 GEMM (cuBLAS, two casts), its logits standing in for x (w
    unread without GEMV). w is always the gate weight as given: a static operand, read before the
    PDL wait (pdl.STATIC_OPERANDS), so never a copy a kernel just wrote -- its rows must be
    contiguous already (a Router's are)."""
    if weight.stride(-1) != 1:
        raise ValueError(
            "the gate weight's rows must be contiguous: it is read before the PDL wait, not copied"
        )
    if gemm:
        return x.contiguous(), weight, x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    logits = torch.nn.functional.linear(x.float(), weight.float()).contiguous()
    return logits, weight, logits


def _checked(path: str | None) -> str | None:
    if path is not None and path not in PATHS:
        raise ValueError(f"router path {path!r}: expected one of {', '.join(PATHS)}")
    return path


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    scaling: float,
    fuse: bool = True,
    path: str | None = None,
    tiles: RouterTiles | None = None,
    block_t: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], gate weight [E, H] → (fp32 weights [T, top_k], int64 expert ids [T, top_k]).

    One launch on the `route_path` paths gemv and dot, else the reference's fp32 GEMM (cuBLAS) and
    the selection in one launch, a program a token. `path`, `tiles` (the dot path's; default
    DOT_TILES) and `block_t` (token rows a program on a GEMM path) override the rule
    (bench/moe_decode_gpu.py)."""
    path = _checked(path) or route_path(x, weight, fuse)
    weights, ids, _, _ = _launch(x, weight, bias, (top_k, n_group, topk_group, scaling), path, tiles, block_t)
    return weights, ids


def folds_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor) -> bool:
    """The one dispatch rule of `normed_route`: at most NORM_MAX_TOKENS tokens on the gemv path
    (`route_path`), a residual of x's shape and dtype, a contiguous norm weight [H] in x's dtype."""
    return (
        0 < x.shape[0] <= NORM_MAX_TOKENS
        and route_path(x, weight) == "gemv"
        and residual.shape == x.shape
        and residual.dtype == norm_w.dtype == x.dtype
        and norm_w.shape == x.shape[1:]
        and norm_w.is_contiguous()
    )


def normed_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The add + RMSNorm before a MoE layer in its router's launch: (weights, ids, weight *
    norm(x + residual), x + residual) -- `norms.rms_norm(x, norm_weight, eps, residual)`, then
    `route` of its row, bit for bit (the norm's helpers, an exact sum of squares) -- where
    `folds_norm` says so; None elsewhere (the caller norms, then routes)."""
    if not folds_norm(x, weight, residual, norm_weight):
        return None
    shape = (top_k, n_group, topk_group, scaling)
    weights, ids, rows, _ = _launch(x, weight, bias, shape, "gemv", None, None, (residual, norm_weight, eps))
    return weights, ids, *rows


def normed_logits(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`normed_route` without the selection: (fp32 logits [T, E], weight * norm(x + residual),
    x + residual), the same bits, for a launch after it that selects the experts itself
    (`moe_one_token.py`'s streaming gate-up): no program takes a ticket or selects. None where
    `folds_norm` says no."""
    if not folds_norm(x, weight, residual, norm_weight):
        return None
    shape, norm = (top_k, n_group, topk_group, 1.0), (residual, norm_weight, eps)
    _, _, rows, logits = _launch(x, weight, bias, shape, "gemv", None, None, norm, select=False)
    return logits, *rows


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    shape: tuple[int, int, int, float],
    path: str,
    tiles: RouterTiles | None,
    block_t: int | None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    select: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
    """`_route_kernel`'s launch on `path`: (weights, ids, with `norm` = (residual, norm weight, eps)
    the normed row and the residual sum it stored (else None), the fp32 logits [T, E] on a GEMM
    path); `shape` = (top_k, n_group, topk_group, scaling). Not `select` (gemv): the logits only,
    weights and ids unwritten."""
    (t, hidden), num_experts = x.shape, weight.shape[0]
    top_k, n_group, topk_group, scaling = shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids, None, None
    if (norm is not None or not select) and path != "gemv":
        raise ValueError(
            f"the router folds the norm or leaves the selection on its gemv path only, not {path!r}"
        )
    gemm = path != "cublas"
    x, weight, logits = _operands(gemm, x, weight)
    r, norm_weight, eps, normed, total = _norm_operands(x, weight, norm)
    block_t, block_e, block_h, split, warps, stages = _tiling(path, t, hidden, num_experts, tiles, block_t)
    partial = logits if split == 1 else logits.new_empty(split, t, num_experts)
    grid = (num_experts // block_e, triton.cdiv(t, block_t), split)
    tickets = tickets_for(x.device, grid[1]) if gemm else ids  # unread without GEMV
    pointers = (x, weight, bias, logits, partial, tickets, weights, ids, r, norm_weight, normed, total)
    _route_kernel[grid](
        *pointers,
        t,
        hidden,
        x.stride(0),
        weight.stride(0),
        scaling,
        eps,
        NUM_EXPERTS=num_experts,
        GROUPS=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_H=block_h,
        GEMV=gemm,
        DOT=path == "dot",
        SPLIT=split,
        PRECISION=dot_precision(x.dtype),
        NORM=norm is not None,
        SELECT=select,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch(x.device),
    )
    return weights, ids, None if norm is None else (normed, total), logits


def _norm_operands(
    x: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor, float] | None
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor]:
    """The launch's residual, norm weight, eps and the rows NORM stores (the normed row, the sum):
    with `norm` = (residual, norm weight, eps) the residual contiguous (read after the wait) and two
    new [T, H] rows; else unread: x, and the gate weight as the norm's (a static operand as given)."""
    if norm is None:
        return x, weight, 0.0, x, x
    residual, norm_weight, eps = norm
    return residual.contiguous(), norm_weight, eps, torch.empty_like(x), torch.empty_like(x)


def route_shapes_supported(num_experts: int, n_group: int, top_k: int) -> bool:
    """tl.arange needs powers of two: the experts per group, the groups and top_k."""
    per_group = num_experts // n_group

    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    return num_experts % n_group == 0 and pow2(per_group) and pow2(n_group) and pow2(top_k)
