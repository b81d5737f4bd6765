"""The (token, expert) pairs of a step laid out by expert in block-padded runs, on the device with
no host sync (so a decode step can be a CUDA graph), and how the expert GEMMs read that layout.

A decode step's few pairs are laid out by one program in one launch; more are counted in parallel,
then laid out. Either layout appends the shared expert's run when `fused_moe` folds it in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import pdl
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels

# Pairs each counting program takes: a decode step's pairs in one program, a prefill's over many.
COUNT_SPAN = 512


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted layout in the worst case: every hit expert's run padded by block_m - 1."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-worst // block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, SPAN: tl.constexpr, USE_PDL: tl.constexpr):
    """Pairs per expert: each program adds one per pair of its SPAN to its expert's count in the
    zeroed `counts`, atomically (integer sums: the same counts in any order). One atomic a pair
    where a program comparing its pairs with every expert took ~7 µs for a c=32 step's 256 pairs
    (one H200, Ling-mini)."""
    wait_for_prior_kernels(USE_PDL)
    offs = tl.program_id(0) * SPAN + tl.arange(0, SPAN)
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    tl.atomic_add(counts_ptr + ids, tl.full((SPAN,), 1, tl.int32), mask=ok, sem="relaxed")


# The shared run's pair numbers stored this many at a time (a decode batch's tokens: one or two).
_SHARED_CHUNK = tl.constexpr(64)


@triton.jit
def _end_runs(
    pairs_ptr, counts_ptr, ends_ptr, num_rows_ptr, ends, num_pairs, shared_rows, BLOCK_M: tl.constexpr
):
    """The rows in use: the routed runs' (`ends`, every expert's), or with `shared_rows` > 0 the
    shared expert's run after them: expert E, `shared_rows` pairs numbered from num_pairs on,
    padded to whole blocks (counts and ends have E + 1 entries)."""
    num_experts: tl.constexpr = ends.shape[0]
    routed_end = tl.max(ends, axis=0)
    if shared_rows == 0:
        tl.store(num_rows_ptr, routed_end)
    else:
        shared_end = routed_end + (shared_rows + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(counts_ptr + num_experts, shared_rows)
        tl.store(ends_ptr + num_experts, shared_end)
        tl.store(num_rows_ptr, shared_end)
        i = tl.arange(0, _SHARED_CHUNK)
        for start in range(0, shared_rows, _SHARED_CHUNK):
            offs = start + i
            tl.store(pairs_ptr + routed_end + offs, num_pairs + offs, mask=offs < shared_rows)


@triton.jit(do_not_specialize=["num_pairs", "shared_rows"])
def _runs_kernel(
    counts_ptr,
    ends_ptr,
    cursor_ptr,
    num_rows_ptr,
    pairs_ptr,
    num_pairs,
    shared_rows,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: each expert's run padded to whole blocks and laid end to end (`ends`, and the
    run starts as the scatter's cursors), and the rows in use with the shared run, if any, after
    them (`_end_runs`)."""
    wait_for_prior_kernels(USE_PDL)
    experts = tl.arange(0, NUM_EXPERTS)
    counts = tl.load(counts_ptr + experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(ends_ptr + experts, ends)
    tl.store(cursor_ptr + experts, ends - padded)
    _end_runs(pairs_ptr, counts_ptr, ends_ptr, num_rows_ptr, ends, num_pairs, shared_rows, BLOCK_M)


@triton.jit
def _scatter_kernel(ids_ptr, pairs_ptr, cursor_ptr, USE_PDL: tl.constexpr):
    """Pair i takes the next row of its expert's run (order within a run does not matter: each
    row's result is computed on its own and written back at its pair index)."""
    wait_for_prior_kernels(USE_PDL)
    i = tl.program_id(0)
    expert = tl.load(ids_ptr + i)
    row = tl.atomic_add(cursor_ptr + expert, 1)
    tl.store(pairs_ptr + row, i)


@triton.jit
def block_rows(pairs_ptr, counts_ptr, ends_ptr, pid_m, BLOCK_M: tl.constexpr, LOG2_EXPERTS: tl.constexpr):
    """The expert of row block `pid_m` (the routed runs that end at or before the block's first
    row, counted over all run ends at once) and the block's pair indices, with a mask of the rows
    that hold one (the rest of a run's last block is padding). A block past every routed run is in
    the shared run (expert E), which only a layout with one has rows for (the kernels skip blocks
    past `num_rows`). Every GEMM program starts here before its first weight load: two independent
    loads of the ends and counts, not a binary search of nine dependent ones (one H200: ~4 µs a
    program at a c=1 step)."""
    num_experts: tl.constexpr = 1 << LOG2_EXPERTS
    first = pid_m * BLOCK_M
    runs = tl.arange(0, num_experts)
    ends = tl.load(ends_ptr + runs)
    counts = tl.load(counts_ptr + runs)
    expert = tl.sum((ends <= first).to(tl.int32), axis=0)  # ends rise with the expert
    end = tl.sum(tl.where(runs == expert, ends, 0), axis=0)
    count = tl.sum(tl.where(runs == expert, counts, 0), axis=0)
    if expert == num_experts:  # the shared run, after every routed one
        end = tl.load(ends_ptr + num_experts)
        count = tl.load(counts_ptr + num_experts)
    run_start = end - (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    valid = rows - run_start < count
    pairs = tl.load(pairs_ptr + rows, mask=valid, other=0)
    return expert.to(tl.int64), pairs, valid


@triton.jit(do_not_specialize=["num_pairs", "shared_rows"])
def _align_one_program_kernel(
    ids_ptr,
    pairs_ptr,
    counts_ptr,
    ends_ptr,
    num_rows_ptr,
    num_pairs,
    shared_rows,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The three kernels above in one program, for a decode step's few pairs: count, lay the padded
    runs end to end, then place each pair at its run's cursor plus the earlier pairs of its expert
    in its chunk (stable: pairs keep their order within a run). Reads the ids in their own dtype.
    `shared_rows` > 0: a last run, expert NUM_EXPERTS, of that many pairs numbered from num_pairs on."""
    wait_for_prior_kernels(USE_PDL)
    experts = tl.arange(0, NUM_EXPERTS)
    counts = tl.zeros((NUM_EXPERTS,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=NUM_EXPERTS).to(tl.int32)
        counts += tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(counts_ptr + experts, counts)
    tl.store(ends_ptr + experts, ends)
    i = tl.arange(0, CHUNK)
    _end_runs(pairs_ptr, counts_ptr, ends_ptr, num_rows_ptr, ends, num_pairs, shared_rows, BLOCK_M)
    cursor = ends - padded
    for start in range(0, num_pairs, CHUNK):
        offs = start + i
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=NUM_EXPERTS).to(tl.int32)
        hit = ids[:, None] == experts[None, :]
        base = tl.sum(tl.where(hit, cursor[None, :], 0), axis=1)
        before = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
        rank = tl.sum(before.to(tl.int32), axis=1)
        tl.store(pairs_ptr + base + rank, offs, mask=ok)
        cursor += tl.sum(hit.to(tl.int32), axis=0)


# Up to this many pairs (a decode batch of 4 tokens at top-8) one program aligns them; past it the
# program's serial chunks cost more than the launches they save. One H200, 2026-11-29, Ling-mini
# (bench/moe_decode_gpu.py, graph-timed): one program 2.7 µs at 8 pairs, 3.3 at 32, 7.4 at 64,
# 12.1 at 128; the multi-launch layout (zero fill, count, runs, scatter) 4.9-5.4 at every size.
ONE_PROGRAM_MAX_PAIRS = 32


def one_program(num_pairs: int, fuse: bool) -> bool:
    """Whether `align_by_expert` lays these pairs out in one launch."""
    return fuse and num_pairs <= ONE_PROGRAM_MAX_PAIRS


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int, fuse: bool = True, shared_rows: int = 0
) -> tuple[torch.Tensor, ...]:
    """ids [T, k] → (sorted_pairs [P], counts [E], ends [E], num_rows [1]), all int32.

    sorted_pairs holds pair indices (token * k + slot) grouped by expert, each expert's run starting
    on a block boundary (`ends`: where each padded run ends; rows past a run's count are padding,
    never written); blocks past `num_rows` are skipped by the kernels. P depends only on T, k, E
    and block_m (graph-safe). No host sync: one launch when `one_program`, else a zero fill and
    three launches that count in parallel. Either way `shared_rows` > 0 appends a run of that many
    pairs numbered T*k on, as expert E (counts and ends get E + 1 entries)."""
    n = ids.numel()
    dev = ids.device
    rows = max_padded_rows(n, num_experts, block_m) + triton.cdiv(shared_rows, block_m) * block_m
    pairs = torch.empty(rows, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    runs = num_experts + (1 if shared_rows else 0)
    if one_program(n, fuse):
        counts, ends = (torch.empty(runs, dtype=torch.int32, device=dev) for _ in range(2))
        _align_one_program_kernel[(1,)](
            ids.reshape(-1),
            pairs,
            counts,
            ends,
            num_rows,
            n,
            shared_rows,
            NUM_EXPERTS=num_experts,
            BLOCK_M=block_m,
            CHUNK=min(64, max(16, triton.next_power_of_2(n))),  # a c=1 step's 8 pairs: one small chunk
            **pdl.launch(dev),
        )
        return pairs, counts, ends, num_rows
    flat = ids.reshape(-1)  # read in its own dtype: no cast launch
    counts = torch.zeros(runs, dtype=torch.int32, device=dev)
    ends = torch.empty(runs, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    _count_kernel[(triton.cdiv(n, COUNT_SPAN),)](flat, counts, n, SPAN=COUNT_SPAN, **pdl.launch(dev))
    _runs_kernel[(1,)](
        counts,
        ends,
        cursor,
        num_rows,
        pairs,
        n,
        shared_rows,
        NUM_EXPERTS=num_experts,
        BLOCK_M=block_m,
        **pdl.launch(dev),
    )
    _scatter_kernel[(n,)](flat, pairs, cursor, **pdl.launch(dev))
    return pairs, counts, ends, num_rows


def align_supported(num_experts: int) -> bool:
    """The one-program count and the binary search need a power-of-two expert count."""
    return num_experts > 0 and num_experts & (num_experts - 1) == 0
