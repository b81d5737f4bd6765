"""Flash-decoding's splits of a decode attention launch: which share of the context a split takes,
the fp32 softmax state each split that holds tokens stores, and the merge of those states by the
last split to finish (`kernels/tickets.py`), in split order: the same sums every launch.
`paged_attention._decode_kernel` calls `split_range` first and `finish` last."""

from __future__ import annotations

import triton
import triton.language as tl
from omnistage.services.thinker.kernels.tickets import last_to_finish

# The merge reads the splits' states this many at a time, the loads of a batch all in flight at once
# (those of splits past the context masked off: nothing read): the first batch's with the maxima,
# so that a context of at most 8 splits' tokens (1,024 at 16 splits of 128) is merged after one
# round trip to L2, 16 splits' after two.
MERGE_BATCH = 8


@triton.constexpr_function
def _merge_batch(splits):
    """The merge's batch for a launch of `splits` splits (no wider than they)."""
    return min(splits, MERGE_BATCH)


@triton.jit
def split_range(ctx, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """This program's share [lo, hi) of a context of `ctx` tokens: split program_id(2) of SPLITS
    whole BLOCK_N steps of at least MIN_CHUNK tokens; one split: all of it. `held`: how many splits
    hold a token, cdiv(ctx, chunk): the first `held`, the others (lo >= ctx) empty; held <= 1:
    split 0 alone holds the whole context (held 0: an empty one)."""
    tl.static_assert(MIN_CHUNK > 0)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    lo = tl.program_id(2) * chunk
    return lo, tl.minimum(ctx, lo + chunk), tl.cdiv(ctx, chunk)


@triton.jit
def _store_rows(out_rows, stride_oh, group, out):
    """The first `group` rows of `out` [rows, D] at `out_rows` (head 0's row), `stride_oh` apart."""
    g, d = tl.arange(0, out.shape[0]), tl.arange(0, out.shape[1])
    rows = out_rows + g[:, None] * stride_oh + d[None, :]
    tl.store(rows, out.to(out_rows.dtype.element_ty), mask=(g < group)[:, None])


@triton.jit
def _store_split(part_ptr, stats_ptr, at, group, m, s, acc):
    """Split state `at`'s real rows (the first `group` of GROUP_PAD) in fp32: max m and sum s
    (stats [2, GROUP_PAD]), values acc (part [GROUP_PAD, D]); the padding rows are not stored."""
    width: tl.constexpr = acc.shape[0]
    g, d = tl.arange(0, width), tl.arange(0, acc.shape[1])
    g_ok = g < group
    tl.store(part_ptr + (at * width + g[:, None]) * acc.shape[1] + d[None, :], acc, mask=g_ok[:, None])
    tl.store(stats_ptr + at * 2 * width + g, m, mask=g_ok)
    tl.store(stats_ptr + (at * 2 + 1) * width + g, s, mask=g_ok)


@triton.jit
def _state_rows(stats_ptr, at, live, r, WIDTH: tl.constexpr):
    """Split state `at`'s rows `r` [ROWS, 1] as the merge reads them → (their maxima's pointers
    (their sums' WIDTH further), the mask: the rows below `live`, none where live is 0)."""
    return stats_ptr + at * 2 * WIDTH + r, r < live


@triton.jit
def _merge_batch_into(
    part_ptr, stats_ptr, first, base, held, group, top, total, out, WIDTH: tl.constexpr, BATCH: tl.constexpr
):
    """(total, out) [ROWS, 1], [ROWS, D] plus split states first + base … + BATCH - 1 in split order,
    each weighted exp(max - top); one past `held` reads nothing and adds 0 x -0 (no bit changed)."""
    r, d = tl.arange(0, out.shape[0])[:, None], tl.arange(0, out.shape[1])[None, :]
    for j in tl.static_range(BATCH):
        at = first + base + j
        m_at, ok = _state_rows(stats_ptr, at, tl.where(base + j < held, group, 0), r, WIDTH)
        m_i = tl.load(m_at, mask=ok, other=float("-inf"), cache_modifier=".cg")
        s_i = tl.load(m_at + WIDTH, mask=ok, other=0.0, cache_modifier=".cg")
        part_at = part_ptr + (at * WIDTH + r) * out.shape[1] + d
        part = tl.load(part_at, mask=ok, other=-0.0, cache_modifier=".cg")
        w = tl.exp(m_i - top)
        total += w * s_i
        out += w * part
    return total, out


@triton.jit
def _merge_splits(
    part_ptr,
    stats_ptr,
    first,
    held,
    group,
    SPLITS: tl.constexpr,
    WIDTH: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The normalised output [ROWS, HEAD_DIM] (its first `group` rows real) of the `held` split
    states from `first` (`_store_split`'s, WIDTH rows each) merged in split order (the same sums
    every launch); bit for bit the merge of all SPLITS states it replaced: an empty split's state
    (-inf, 0, 0) added weight exp(-inf - top) = 0 times 0 to each sum, which changes none but makes
    a -0 +0, so +0 is added once here where any split is empty. Reads those splits' real rows only:
    the maxima and the first BATCH splits' states in one go, the rest (past BATCH) a batch a time."""
    BATCH: tl.constexpr = _merge_batch(SPLITS)
    r = tl.arange(0, ROWS)[:, None]  # [ROWS, 1] and [ROWS, HEAD_DIM]: one layout, no shuffle
    top = tl.full((ROWS, 1), float("-inf"), dtype=tl.float32)
    for i in tl.static_range(SPLITS):  # a max is exact in any order
        m_at, ok = _state_rows(stats_ptr, first + i, tl.where(i < held, group, 0), r, WIDTH)
        top = tl.maximum(top, tl.load(m_at, mask=ok, other=float("-inf"), cache_modifier=".cg"))
    top = tl.where(top == float("-inf"), 0.0, top)  # a row of no state: every weight 0, no NaN
    total = tl.zeros((ROWS, 1), dtype=tl.float32)
    out = tl.zeros((ROWS, HEAD_DIM), dtype=tl.float32)
    total, out = _merge_batch_into(part_ptr, stats_ptr, first, 0, held, group, top, total, out, WIDTH, BATCH)
    for base in range(BATCH, held, BATCH):  # more than BATCH splits hold tokens
        total, out = _merge_batch_into(
            part_ptr, stats_ptr, first, base, held, group, top, total, out, WIDTH, BATCH
        )
    # The empty splits' +0 (a -0 — a product below the smallest float fused-added to +0 — made +0);
    # -0, no change, where every split holds tokens.
    out += tl.where(held < SPLITS, 0.0, -0.0)
    return out / tl.maximum(total, 1e-30)


@triton.jit
def finish(
    out_rows,
    stride_oh,
    group,
    part_ptr,
    stats_ptr,
    tickets_ptr,
    m,
    s,
    acc,
    held,
    SPLITS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The output rows (from `out_rows`, `stride_oh` apart) of the group's `group` query heads: this
    program's normalised state (one split, or split 0 alone with the whole context: no merge, no
    ticket), or the merge of the `held` splits that hold tokens by the last of them to finish (held
    tickets: the empty splits take none)."""
    if SPLITS == 1:
        _store_rows(out_rows, stride_oh, group, acc / tl.maximum(s, 1e-30)[:, None])
    elif held <= 1:
        _store_rows(out_rows, stride_oh, group, acc / tl.maximum(s, 1e-30)[:, None])
    else:
        pair = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        _store_split(part_ptr, stats_ptr, pair * SPLITS + tl.program_id(2), group, m, s, acc)
        if last_to_finish(tickets_ptr, pair, held):
            width: tl.constexpr = acc.shape[0]
            dim: tl.constexpr = acc.shape[1]
            out = _merge_splits(part_ptr, stats_ptr, pair * SPLITS, held, group, SPLITS, width, ROWS, dim)
            _store_rows(out_rows, stride_oh, group, out)
