"""Routed experts in Triton with no host sync (so a decode step can be a CUDA graph): the pairs laid
out by expert in block-padded runs (`moe_align.py`), the two GEMMs over those runs, then each
token's pairs summed with the shared expert's output.

In a decode step the shared expert is folded in as one more run (expert E, weight 1, every token):
its GEMMs ride in the routed launches instead of three of their own (gate/up GEMM, SiLU·mul, down).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import dot_precision, moe_one_token, pdl
from omnistage.services.thinker.kernels.moe_align import align_by_expert, block_rows
from omnistage.services.thinker.kernels.norms import silu_mul
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels


@dataclass(frozen=True)
class GemmTiles:
    """One expert GEMM's tiles past the row block: output columns and reduction step a program,
    warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeTiles:
    """Both GEMMs' tiles: one row block (the alignment pads each expert's run to it) and each
    GEMM's own (gate-up: N the intermediate, K the hidden; down: the other way round)."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles


# Measured tiles by (experts, N, K, pairs bucket): N the intermediate size per rank, K the hidden
# size, the bucket `pairs_bucket` of the routed pairs. bench/moe_decode_gpu.py times a sweep on the
# GPU and prints these entries (its PASTE lines) for a shape's decode batches; a key not here takes
# `rule_tiles`. Ling-mini TP=1's entries: one H200, 2026-11-29, bench/moe_decode_gpu.py's sweep (pairs
# buckets 8-128 timed with the shared run folded in, 256 and 512 without), 1-10 % under the rule's.
TILES: dict[tuple[int, int, int, int], MoeTiles] = {
    (256, 512, 2048, 8): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4),
        down=GemmTiles(block_n=64, block_k=64, num_warps=4, num_stages=4),
    ),  # ling-mini tp1 T=1: 23.1 us vs the rule's 23.7
    (256, 512, 2048, 16): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=32, block_k=128, num_warps=4, num_stages=3),
        down=GemmTiles(block_n=64, block_k=64, num_warps=4, num_stages=3),
    ),  # ling-mini tp1 T=2: 34.2 us vs the rule's 38.2
    (256, 512, 2048, 32): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=32, block_k=128, num_warps=4, num_stages=3),
        down=GemmTiles(block_n=64, block_k=64, num_warps=4, num_stages=2),
    ),  # ling-mini tp1 T=4: 57.2 us vs the rule's 63.5
    (256, 512, 2048, 64): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=2),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
    ),  # ling-mini tp1 T=8: 98.6 us vs the rule's 101.9
    (256, 512, 2048, 128): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=32, block_k=256, num_warps=4, num_stages=3),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
    ),  # ling-mini tp1 T=16: 161.9 us vs the rule's 164.1
    (256, 512, 2048, 256): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=32, block_k=256, num_warps=4, num_stages=2),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
    ),  # ling-mini tp1 T=32: 245.1 us vs the rule's 248.9
    (256, 512, 2048, 512): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
    ),  # ling-mini tp1 T=64: 332.5 us vs the rule's 337.2
    # Ming-flash's thinker at TP=2, one rank (E 256, I 512, H 4096): one H200, 2026-11-29 (session 5),
    # bench/moe_decode_gpu.py --shapes 'ming-flash tp2' (decode T=1-64, 129 of 144 configs) and --space
    # prefill (T=64-4096, one per bucket, 66 of 144 configs): 1-12 % under the rule's.
    (256, 512, 4096, 8): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=32, block_k=128, num_warps=4, num_stages=4),
        down=GemmTiles(block_n=64, block_k=64, num_warps=4, num_stages=3),
    ),  # ming-flash tp2 T=1: 34.5 us vs the rule's 38.0
    (256, 512, 4096, 16): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=32, block_k=128, num_warps=4, num_stages=3),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
    ),  # ming-flash tp2 T=2: 58.8 us vs the rule's 67.6
    (256, 512, 4096, 32): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4),
        down=GemmTiles(block_n=128, block_k=128, num_warps=4, num_stages=2),
    ),  # ming-flash tp2 T=4: 100.5 us vs the rule's 109.0
    (256, 512, 4096, 64): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=3),
        down=GemmTiles(block_n=128, block_k=128, num_warps=4, num_stages=2),
    ),  # ming-flash tp2 T=8: 175.9 us vs the rule's 183.8
    (256, 512, 4096, 128): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
    ),  # ming-flash tp2 T=16: 306.0 us vs the rule's 314.8
    (256, 512, 4096, 256): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=2),
    ),  # ming-flash tp2 T=32: 481.9 us vs the rule's 494.5
    (256, 512, 4096, 512): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=128, block_k=128, num_warps=4, num_stages=3),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
    ),  # ming-flash tp2 T=64: 641.7 us vs the rule's 658.1
    (256, 512, 4096, 1024): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=3),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=2),
    ),  # ming-flash tp2 T=128: 727.4 us vs the rule's 744.7
    (256, 512, 4096, 2048): MoeTiles(
        block_m=16,
        gate_up=GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=2),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=2),
    ),  # ming-flash tp2 T=256: 752.4 us vs the rule's 803.7
    (256, 512, 4096, 4096): MoeTiles(
        block_m=32,
        gate_up=GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=3),
        down=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
    ),  # ming-flash tp2 T=512: 773.7 us vs the rule's 825.2
    (256, 512, 4096, 8192): MoeTiles(
        block_m=64,
        gate_up=GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=4),
        down=GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=4),
    ),  # ming-flash tp2 T=1024: 878.2 us vs the rule's 958.6
    (256, 512, 4096, 16384): MoeTiles(
        block_m=128,
        gate_up=GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=4),
        down=GemmTiles(block_n=128, block_k=64, num_warps=4, num_stages=3),
    ),  # ming-flash tp2 T=2048: 1082.1 us vs the rule's 1161.0
    (256, 512, 4096, 32768): MoeTiles(
        block_m=128,
        gate_up=GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=4),
        down=GemmTiles(block_n=128, block_k=64, num_warps=4, num_stages=3),
    ),  # ming-flash tp2 T=4096: 1595.5 us vs the rule's 1803.7
}


# Up to this many routed pairs (a decode batch of 64 tokens at top-8) `fused_experts` folds the
# shared expert in as one more run of the routed GEMMs, in either alignment layout; past it (a
# prefill) the shared expert is its own GEMMs (cuBLAS) and SiLU·mul. Folding saves those three
# launches a layer (one H200, Ling-mini c=64: 0.11 + 0.19 ms a step unfolded). It folded only up to
# 16 tokens before (the one-program alignment's limit then); folded vs not at every decode size is
# bench/moe_decode_gpu.py's `moe` rows, not measured yet: this threshold comes from them.
SHARED_FOLD_MAX_PAIRS = 512


def folds_shared(num_pairs: int, fuse: bool) -> bool:
    """Whether `fused_experts` runs the shared expert (when its shape is an expert's) as a run of
    the routed GEMMs for a step of `num_pairs` routed pairs."""
    return fuse and num_pairs <= SHARED_FOLD_MAX_PAIRS


def pairs_bucket(num_pairs: int) -> int:
    """The table's key for a step's routed pairs: the next power of two (a decode batch of T tokens
    at top-8 is 8T pairs)."""
    return triton.next_power_of_2(max(1, num_pairs))


def rule_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """From the average rows an expert gets: a decode batch touches each expert with a few rows
    (small-M tiles, memory-bound), a prefill with many."""
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 4:
        block_m, tiles = 16, GemmTiles(32, 128, 4, 4)
    elif per_expert <= 32:
        block_m, tiles = 32, GemmTiles(64, 64, 4, 3)
    else:
        block_m, tiles = 64, GemmTiles(128, 64, 8, 3)
    return MoeTiles(block_m, tiles, tiles)


def choose_tiles(num_pairs: int, num_experts: int, intermediate: int = 0, hidden: int = 0) -> MoeTiles:
    """The measured TILES entry of this shape and pair count, else `rule_tiles`."""
    measured = TILES.get((num_experts, intermediate, hidden, pairs_bucket(num_pairs)))
    return measured or rule_tiles(num_pairs, num_experts)


def gemm_meta(block_m: int, tiles: GemmTiles, num_experts: int, dtype: torch.dtype) -> dict:
    """`_expert_gemm`'s launch constants for one GEMM."""
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        LOG2_EXPERTS=num_experts.bit_length() - 1,
        PRECISION=dot_precision(dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


@triton.jit
def _expert_weights(w_ptr, shared_w_ptr, expert, stride_we, LOG2_EXPERTS: tl.constexpr):
    """The weights of `expert`: its slice of the stacked tensor, or the shared expert's (expert E,
    the run the alignment appends when the shared expert is folded in; same row stride)."""
    base = w_ptr + expert * stride_we
    if expert == (1 << LOG2_EXPERTS):
        base = shared_w_ptr
    return base


@triton.jit
def _input_rows(pairs, valid, pairs_per_row, num_pairs, GATED: tl.constexpr):
    """The rows of the GEMM's input the block's pairs read: a routed pair p row p // pairs_per_row;
    a shared-run pair num_pairs + t of the gate-up GEMM its token's row t (the down GEMM reads the
    intermediate by pair: pairs_per_row 1); padding row 0."""
    rows = pairs // pairs_per_row
    if GATED:
        rows = tl.where(pairs >= num_pairs, pairs - num_pairs, rows)
    return tl.where(valid, rows, 0).to(tl.int64)


@triton.jit
def _epilogue(acc, acc_u, weight_ptr, pairs, num_pairs, dt: tl.constexpr, GATED: tl.constexpr):
    """GATED: silu(gate)·up; else the expert's output rounded to the activation dtype (as the
    reference rounds it), times the pair's routing weight (1 for a shared-run pair)."""
    if GATED:  # one return: the compiler types every return alike, a static branch's too
        result = silu_mul(acc, acc_u, dt)
    else:
        weight = tl.load(weight_ptr + pairs, mask=pairs < num_pairs, other=1.0)
        result = acc.to(dt).to(tl.float32) * weight[:, None]
    return result


@triton.jit(do_not_specialize=["num_pairs"])  # a step's count: one compile for every size
def _expert_gemm_kernel(
    a_ptr,
    w_ptr,
    shared_w_ptr,
    out_ptr,
    weight_ptr,
    pairs_ptr,
    counts_ptr,
    ends_ptr,
    num_rows_ptr,
    n_out,
    k_in,
    pairs_per_row,
    num_pairs,
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
    USE_PDL: tl.constexpr,
):
    """One row block of an expert's run x BLOCK_N columns: out[pair] = a[pair // pairs_per_row] @ w[expert]ᵀ;
    GATED (gate-up): w's first n_out rows the gate, the next n_out the up projection, the result
    silu(gate)·up; else (down): the result weighted by the pair's routing weight. Pairs from
    num_pairs on are the folded shared expert's (expert E, `shared_w_ptr`'s weights, weight 1): in
    the gate-up GEMM pair num_pairs + t reads row t; the down GEMM reads its rows by pair."""
    wait_for_prior_kernels(USE_PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert, pairs, valid = block_rows(pairs_ptr, counts_ptr, ends_ptr, pid_m, BLOCK_M, LOG2_EXPERTS)
    rows = _input_rows(pairs, valid, pairs_per_row, num_pairs, GATED)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_base = _expert_weights(w_ptr, shared_w_ptr, expert, stride_we, LOG2_EXPERTS) + offs_k[:, None]
    b_ptrs = w_base + offs_n[None, :] * stride_wn
    u_ptrs = w_base + (offs_n[None, :] + n_out) * stride_wn  # GATED only: the up rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros_like(acc)  # GATED only
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
    result = _epilogue(acc, acc_u, weight_ptr, pairs, num_pairs, a_ptr.dtype.element_ty, GATED)
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, result, mask=valid[:, None] & n_ok[None, :])


def _expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    layout: tuple[torch.Tensor, ...],
    meta: dict,
    *,
    num_pairs: int,
    shared_w: torch.Tensor | None = None,
    pairs_per_row: int = 1,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch of `_expert_gemm_kernel` over `align_by_expert`'s layout; gated when no routing
    `weights` are given (w [E, 2N, K]: gate rows then up rows), else w [E, N, K]. `shared_w`: the
    folded shared expert's weights (expert E of a layout with a shared run; num_pairs routed pairs
    before it)."""
    gated = weights is None
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    grid = (layout[0].numel() // meta["BLOCK_M"], triton.cdiv(n_out, meta["BLOCK_N"]))
    _expert_gemm_kernel[grid](
        a,
        w,
        w if shared_w is None else shared_w,
        out,
        out if gated else weights,
        *layout,
        n_out,
        w.shape[2],
        pairs_per_row,
        num_pairs,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        GATED=gated,
        **meta,
        **pdl.launch(a.device),
    )
    return out


@triton.jit
def _combine_kernel(
    partial_ptr,
    shared_ptr,
    out_ptr,
    hidden,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t] = round(sum over the k pairs of t) (+ shared[t], rounded again): the reference's sum,
    its cast to the activation dtype and the shared expert's add in one launch."""
    wait_for_prior_kernels(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        acc += tl.load(partial_ptr + (t * TOP_K + s) * hidden + cols, mask=ok, other=0.0)
    dt = out_ptr.dtype.element_ty
    y = acc.to(dt)
    if HAS_SHARED:
        y = (
            y.to(tl.float32) + tl.load(shared_ptr + t * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        ).to(dt)
    tl.store(out_ptr + t * hidden + cols, y, mask=ok)


def combine_pairs(
    partial: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype, fuse: bool
) -> torch.Tensor:
    """fp32 per-pair outputs [T, k, H] → [T, H] in `dtype` (+ shared): one launch when `fuse`."""
    t, k, hidden = partial.shape
    if not fuse:
        out = partial.sum(dim=1).to(dtype)
        return out if shared is None else out + shared
    out = torch.empty(t, hidden, dtype=dtype, device=partial.device)
    if shared is not None:
        shared = shared.contiguous()
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(t, triton.cdiv(hidden, block))](
        partial,
        out if shared is None else shared,
        out,
        hidden,
        TOP_K=k,
        HAS_SHARED=shared is not None,
        BLOCK=block,
        **pdl.launch(partial.device),
    )
    return out


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    fuse: bool = True,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], weights/ids [T, k] and the
    shared expert's (gate_up [2I', H], down [H, I']) → [T, H] in x's dtype: the routed mix summed in
    fp32 and rounded, plus the shared expert's output (FusedExperts.forward).

    `fuse`: a decode step's fusions -- one token in two launches (`moe_one_token.py`), more with
    the sum in one launch and the shared expert folded in (`folds_shared`) when its shape is an
    expert's; False: the launches of the reference ops (a
    same-build comparison).
    `tiles` overrides `choose_tiles` (bench/moe_decode_gpu.py)."""
    t, k = ids.shape
    num_experts, two_i, hidden = w13.shape
    if t == 0:
        return torch.zeros(0, hidden, dtype=x.dtype, device=x.device)
    if fuse and tiles is None and moe_one_token.supported(x, w13, w2, ids, shared):
        return moe_one_token.one_token_experts(x, w13, w2, weights, ids, shared)
    n = t * k
    fold = shared is not None and folds_shared(n, fuse) and _foldable(shared, w13, w2)
    shared_out = _shared_expert(x, *shared) if shared is not None and not fold else None
    shared_w = shared if fold else (None, None)
    rows = n + (t if fold else 0)  # the folded shared expert's pairs after the routed ones
    tiles = tiles or choose_tiles(n, num_experts, two_i // 2, hidden)
    layout = align_by_expert(ids, num_experts, tiles.block_m, fuse, rows - n)
    meta = gemm_meta(tiles.block_m, tiles.gate_up, num_experts, x.dtype)
    h = torch.empty(rows, two_i // 2, dtype=x.dtype, device=x.device)
    _expert_gemm(x.contiguous(), w13, h, layout, meta, num_pairs=n, shared_w=shared_w[0], pairs_per_row=k)
    out = torch.empty(rows, hidden, dtype=torch.float32, device=x.device)
    routing = weights.reshape(-1).float().contiguous()  # the router's fp32 weights: no copy
    meta = gemm_meta(tiles.block_m, tiles.down, num_experts, x.dtype)
    _expert_gemm(h, w2, out, layout, meta, num_pairs=n, shared_w=shared_w[1], weights=routing)
    if fold:
        shared_out = out[n:]
    return combine_pairs(out[:n].view(t, k, hidden), shared_out, x.dtype, fuse)


def _foldable(shared: tuple[torch.Tensor, torch.Tensor], w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The shared expert can run as expert E: an expert's shape and row strides, rows contiguous."""
    gate_up, down = shared
    return (
        gate_up.shape == w13.shape[1:]
        and down.shape == w2.shape[1:]
        and gate_up.stride() == w13.stride()[1:]
        and down.stride() == w2.stride()[1:]
        and gate_up.dtype == w13.dtype
        and down.dtype == w2.dtype
    )


def _shared_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """GatedMLP's forward with the fast path's SiLU·mul (a prefill, or a shape that does not fold)."""
    from omnistage.services.thinker.kernels.norms import silu_and_mul

    return F.linear(silu_and_mul(F.linear(x, gate_up)), down)
