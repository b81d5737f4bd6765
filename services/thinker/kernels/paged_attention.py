"""Paged KV writes and paged decode attention in Triton, with every length read on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import dot_precision, pdl
from omnistage.services.thinker.kernels.norms import norm_rope_heads
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels
from omnistage.services.thinker.kernels.split_merge import finish, split_range
from omnistage.services.thinker.kernels.tickets import tickets_for


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_vt, width, BLOCK: tl.constexpr
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < width
        tl.store(k_cache_ptr + slot * width + offs, tl.load(k_ptr + t * stride_kt + offs, mask=ok), mask=ok)
        tl.store(v_cache_ptr + slot * width + offs, tl.load(v_ptr + t * stride_vt + offs, mask=ok), mask=ok)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k/v [T, KVH, D] into the caches at `slots` [T] (block * block_size + offset); slot < 0: skipped."""
    t = k.shape[0]
    if t == 0:
        return
    width = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(t, width), v.reshape(t, width)
    _write_kv_kernel[(t,)](
        k2,
        v2,
        k_cache,
        v_cache,
        slots,
        k2.stride(0),
        v2.stride(0),
        width,
        BLOCK=min(1024, triton.next_power_of_2(width)),
    )


@triton.jit
def kv_rows(block, tok, d, cache, PAGE: tl.constexpr):
    """The offsets [len(tok), len(d)] in the K (and V) cache of the rows of cached positions `tok`
    (`block`: their pages, the block-table entries at tok // PAGE) of one KV head; `cache` = (that
    head, the cache's block, slot and head strides)."""
    kvh, stride_cb, stride_cs, stride_ch = cache
    return (
        block.to(tl.int64)[:, None] * stride_cb
        + (tok % PAGE)[:, None] * stride_cs
        + kvh * stride_ch
        + d[None, :]
    )


@triton.jit
def load_kv(
    k_cache_ptr, v_cache_ptr, table, tok, tok_ok, kvh, d, stride_cb, stride_cs, stride_ch, PAGE: tl.constexpr
):
    """K and V rows [len(tok), len(d)] of KV head `kvh` at the cached positions `tok` (zeros where not
    `tok_ok`), through the sequence's block-table row `table`; both paged kernels read the cache so."""
    block = tl.load(table + tok // PAGE, mask=tok_ok, other=0)
    kv_off = kv_rows(block, tok, d, (kvh, stride_cb, stride_cs, stride_ch), PAGE)
    k = tl.load(k_cache_ptr + kv_off, mask=tok_ok[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=tok_ok[:, None], other=0.0)
    return k, v


@triton.jit
def settled(tok, hi, ctx):
    """Which rows of cached positions `tok` [N] a decode program reads before its PDL wait, as a
    mask [N, 1]: those of its split (below `hi`) written by earlier steps (all but the context's
    last, ctx - 1: this step's row, read after the wait; pdl.SETTLED_OPERANDS)."""
    return ((tok < hi) & (tok < ctx - 1))[:, None]


@triton.jit
def _attend_tile(q, k, v, tok_ok, m, s, acc, PRECISION: tl.constexpr):
    """The online-softmax state (m, s, acc) after one tile of K and V rows [BLOCK_N, D] (`tok_ok`:
    the rows in range; their others are zeros)."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    scores = tl.where(tok_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    s = s * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, s, acc


@triton.jit
def _attend_range(
    q,
    k_cache_ptr,
    v_cache_ptr,
    table,
    lo,
    hi,
    cache,
    m,
    s,
    acc,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The online-softmax state (m, s, acc: running max [GROUP_PAD], sum of exponentials [GROUP_PAD],
    weighted values [GROUP_PAD, D], all fp32, unnormalised) after q [GROUP_PAD, D] over one
    sequence's cached tokens [lo, hi) of `cache`'s KV head (`kv_rows`; `table`: the sequence's
    block-table row), BLOCK_N tokens per iteration; an empty range leaves it as it was."""
    kvh, stride_cb, stride_cs, stride_ch = cache
    d = tl.arange(0, q.shape[1])
    offs = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs
        tok_ok = tok < hi
        k, v = load_kv(
            k_cache_ptr, v_cache_ptr, table, tok, tok_ok, kvh, d, stride_cb, stride_cs, stride_ch, PAGE
        )
        m, s, acc = _attend_tile(q, k, v, tok_ok, m, s, acc, PRECISION)
    return m, s, acc


@triton.jit
def _empty_state(ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The online softmax's state before any token: (-inf, 0, 0)."""
    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    return m, tl.zeros((ROWS,), dtype=tl.float32), tl.zeros((ROWS, HEAD_DIM), dtype=tl.float32)


@triton.jit
def _attend_split(
    q,
    k_cache_ptr,
    v_cache_ptr,
    table,
    pre,
    newest_page,
    lo,
    hi,
    ctx,
    cache,
    PAGE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The split's online-softmax state over [lo, hi): first its tiles read before the wait (`pre`:
    (K rows, V rows [BLOCK_N, D]) of BLOCK_N positions each from lo, their `settled` rows), each that
    starts below hi completed by the row still to read if it holds it (the context's last, this
    step's, now written: in page `newest_page`, also read before the wait) and attended; then the
    rest of the split tile by tile. The same tiles in the same order however many were read before
    the wait: the same bits."""
    block_n: tl.constexpr = pre[0][0].shape[0]
    kvh, stride_cb, stride_cs, stride_ch = cache
    newest = ctx - 1
    row = newest_page.to(tl.int64) * stride_cb + (newest % PAGE) * stride_cs + kvh * stride_ch
    # The newest row's offsets on each row of a tile: its loads read it where `late` (one row, or none).
    at = tl.broadcast_to(row + tl.arange(0, q.shape[1])[None, :], (block_n, q.shape[1]))
    m, s, acc = _empty_state(q.shape[0], q.shape[1])
    for j in tl.static_range(len(pre)):
        k, v = pre[j]
        tok = lo + j * block_n + tl.arange(0, block_n)
        if lo + j * block_n < hi:
            late = ((tok == newest) & (tok < hi))[:, None]
            k = tl.where(late, tl.load(k_cache_ptr + at, mask=late, other=0.0), k)
            v = tl.where(late, tl.load(v_cache_ptr + at, mask=late, other=0.0), v)
            m, s, acc = _attend_tile(q, k, v, tok < hi, m, s, acc, PRECISION)
    rest = lo + len(pre) * block_n
    return _attend_range(
        q, k_cache_ptr, v_cache_ptr, table, rest, hi, cache, m, s, acc, PAGE, block_n, PRECISION
    )


@triton.jit
def _load_q(
    q_ptr,
    b,
    heads,
    h_ok,
    d,
    stride_qb,
    stride_qh,
    scale,
    w_ptr,
    cos_row,
    sin_row,
    eps,
    ROT: tl.constexpr,
    NORM: tl.constexpr,
):
    """Sequence b's query heads `heads` [GROUP_PAD, D] times the softmax scale, in q's dtype; with
    ROT > 0 QK-normed (NORM, the weight at `w_ptr`) and roped (the token's cos/sin rows) on load."""
    rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    if ROT > 0:
        q = norm_rope_heads(rows, h_ok[:, None], w_ptr, cos_row, sin_row, eps, ROT, NORM, "")
    else:
        q = tl.load(rows, mask=h_ok[:, None], other=0.0)
    return (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)


@triton.jit
def _write_row(
    k_cache_ptr,
    v_cache_ptr,
    slot,
    new_kv,
    d,
    cache,
    rope,
    PAGE: tl.constexpr,
    ROT: tl.constexpr,
    NORM: tl.constexpr,
):
    """The new token's K and V head rows (`new_kv`: their starts, `d` their head dim) into the cache
    rows at `slot` of `cache`'s KV head (that head, the cache's strides); with ROT > 0 the K row QK-normed (NORM) and
    roped on its way in (`norm_rope_heads`, `rope` = (the norm weight, the token's cos and sin
    rows, eps)): the split that writes it, its only reader, reads it so."""
    kvh, stride_cb, stride_cs, stride_ch = cache
    row = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kvh * stride_ch + d
    new_k, new_v = new_kv
    if ROT > 0:
        kw_ptr, cos_row, sin_row, eps = rope
        key = norm_rope_heads(new_k + d, d < d.shape[0], kw_ptr, cos_row, sin_row, eps, ROT, NORM, "")
    else:
        key = tl.load(new_k + d)
    tl.store(k_cache_ptr + row, key)
    tl.store(v_cache_ptr + row, tl.load(new_v + d))


@triton.jit(do_not_specialize=["stride_tb"])  # the step's block-table width: one compile
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    ctx_ptr,
    out_ptr,
    part_ptr,
    stats_ptr,
    tickets_ptr,
    scale,
    group,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_tb,
    stride_cb,
    stride_cs,
    stride_ch,
    k_ptr,
    v_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    stride_ct,
    eps,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRELOAD_TILES: tl.constexpr,
    PRECISION: tl.constexpr,
    WRITE_KV: tl.constexpr,
    SPLITS: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    ROT: tl.constexpr,
    NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (sequence, KV head, split): its group's online softmax (fp32) over its split, merged by
    the last split to finish of those holding tokens (`split_merge`); GROUP_ROWS: the group's size
    to a power of two; WRITE_KV: the split with the last token, its only reader, stores it (ROT > 0:
    QK-normed and roped on its way in, as q on load). Before the wait (SETTLED_OPERANDS): the step's
    staged inputs, the page of the context's last row, and the split's first PRELOAD_TILES (1 to 4)
    tiles of BLOCK_N positions, their rows of earlier steps (`settled`: all but the context's last,
    this step's, read after the wait); `_attend_split` the rest."""
    b, kvh = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    lo, hi, held = split_range(ctx, SPLITS, BLOCK_N, MIN_CHUNK)
    d, cache, row = tl.arange(0, HEAD_DIM), (kvh, stride_cb, stride_cs, stride_ch), b * stride_tb
    t0 = lo + tl.arange(0, BLOCK_N)
    at0 = kv_rows(tl.load(tables_ptr + row + t0 // PAGE, mask=t0 < hi, other=0), t0, d, cache, PAGE)
    k0 = tl.load(k_cache_ptr + at0, mask=settled(t0, hi, ctx), other=0.0)
    v0 = tl.load(v_cache_ptr + at0, mask=settled(t0, hi, ctx), other=0.0)
    pre = ((k0, v0),)
    if PRELOAD_TILES > 1:
        t1 = t0 + BLOCK_N
        at1 = kv_rows(tl.load(tables_ptr + row + t1 // PAGE, mask=t1 < hi, other=0), t1, d, cache, PAGE)
        k1 = tl.load(k_cache_ptr + at1, mask=settled(t1, hi, ctx), other=0.0)
        v1 = tl.load(v_cache_ptr + at1, mask=settled(t1, hi, ctx), other=0.0)
        pre = pre + ((k1, v1),)
    if PRELOAD_TILES > 2:
        t2 = t0 + 2 * BLOCK_N
        at2 = kv_rows(tl.load(tables_ptr + row + t2 // PAGE, mask=t2 < hi, other=0), t2, d, cache, PAGE)
        k2 = tl.load(k_cache_ptr + at2, mask=settled(t2, hi, ctx), other=0.0)
        v2 = tl.load(v_cache_ptr + at2, mask=settled(t2, hi, ctx), other=0.0)
        pre = pre + ((k2, v2),)
    if PRELOAD_TILES > 3:
        t3 = t0 + 3 * BLOCK_N
        at3 = kv_rows(tl.load(tables_ptr + row + t3 // PAGE, mask=t3 < hi, other=0), t3, d, cache, PAGE)
        k3 = tl.load(k_cache_ptr + at3, mask=settled(t3, hi, ctx), other=0.0)
        v3 = tl.load(v_cache_ptr + at3, mask=settled(t3, hi, ctx), other=0.0)
        pre = pre + ((k3, v3),)
    newest_page = tl.load(tables_ptr + row + (ctx - 1) // PAGE, mask=(lo < ctx) & (hi == ctx), other=0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    wait_for_prior_kernels(USE_PDL)
    if (lo >= ctx) & (tl.program_id(2) > 0):
        return  # past the context: no state, no ticket (split 0 of an empty one writes its zeros)
    g = tl.arange(0, GROUP_PAD)
    heads, h_ok = kvh * group + g, g < group
    cos_row, sin_row = cos_ptr + b * stride_ct, sin_ptr + b * stride_ct
    if WRITE_KV:  # (split 0 of an empty context: hi == ctx == 0)
        if (slot >= 0) & (hi == ctx):
            new_kv = (k_ptr + b * stride_kt + kvh * stride_kh, v_ptr + b * stride_vt + kvh * stride_vh)
            rope = (kw_ptr, cos_row, sin_row, eps)
            _write_row(k_cache_ptr, v_cache_ptr, slot, new_kv, d, cache, rope, PAGE, ROT, NORM)
        tl.debug_barrier()  # the row stored before any thread of this program reads the cache
    q = _load_q(
        q_ptr, b, heads, h_ok, d, stride_qb, stride_qh, scale, qw_ptr, cos_row, sin_row, eps, ROT, NORM
    )
    table = tables_ptr + row
    m, s, acc = _attend_split(
        q, k_cache_ptr, v_cache_ptr, table, pre, newest_page, lo, hi, ctx, cache, PAGE, PRECISION
    )
    out_rows = out_ptr + b * stride_ob + (kvh * group) * stride_oh  # the group's first head
    finish(out_rows, stride_oh, group, part_ptr, stats_ptr, tickets_ptr, m, s, acc, held, SPLITS, GROUP_ROWS)


def paged_strides(
    q: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor
) -> tuple[int, ...]:
    """What both paged kernels (decode, prefill) take after their scalars: query and output strides
    (token, head), the block-table row stride, the cache's (block, slot, KV head) strides."""
    return (
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
    )


# A decode launch of fewer (sequence, KV head) programs than this splits each over the context
# (flash-decoding) into about this many programs, at most MAX_SPLITS a pair: one H200 has 132 SMs,
# and Ling-mini's c=1 step ran 4 programs, each serial over the whole context (8.8 µs a layer).
# A split takes at least SPLIT_MIN_TOKENS: one H200, 2026-11-29 (bench/attention_decode_gpu.py,
# Ling-mini, graph-timed µs a call, 1 sequence): the whole context 5.6 (128 tokens), 14.6 (512),
# 53.8 (2048); 16 splits 7.0, 7.0, 8.3 -- at 128 tokens the split's store-and-merge costs more than it
# saves, so a context up to SPLIT_MIN_TOKENS runs in split 0 alone (no merge, no ticket).
SPLIT_TARGET_PROGRAMS = 128
MAX_SPLITS = 16
SPLIT_MIN_TOKENS = 128


def decode_splits(num_seqs: int, num_kv_heads: int) -> int:
    """Context splits a program of a decode launch of this shape (never of the context: a captured
    graph replays it at every length; splits past a short context do nothing)."""
    return max(1, min(MAX_SPLITS, SPLIT_TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads)))


def launch_splits(num_seqs: int, num_kv_heads: int, on_gpu: bool) -> int:
    """The splits `paged_decode` launches by default: `decode_splits` on a GPU, 1 under the
    interpreter (no gain there)."""
    return decode_splits(num_seqs, num_kv_heads) if on_gpu else 1


# A decode program reads at most this many tiles of its split before its PDL wait (`DecodeTiles`).
# sm_90 registers a thread (ptxas on Triton's code with a launch's 16-byte alignments, Ling-mini's
# shape, 16 splits; 2026-11-29, unmeasured on a GPU): 1 tile 166 at 4 warps, 73 at 8; 2 tiles 217,
# 128; 4 tiles 255 and ~300 bytes spilled at 4 warps, 197 at 8 (the QK-norm + rope folded: ±10).
MAX_PRELOAD_TILES = 4


@dataclass(frozen=True)
class DecodeTiles:
    """How each program of a decode launch reads its split: its first `preload_tiles` tiles of
    BLOCK_N positions before its PDL wait (1 … MAX_PRELOAD_TILES; their rows of earlier steps, all
    loads in flight together while the kernel before runs, each tile's K and V, 2 x BLOCK_N x head
    dim elements, held in registers across the wait), the rest a tile at a time after it; in
    `warps` warps. preload_tiles changes when loads are issued, never the tiles, their order or
    the sums: the same bits at any; warps lay the sums' reductions out apart (bits may differ)."""

    preload_tiles: int = 1
    warps: int = 4
    # A split's fewest tokens (`split_range`'s MIN_CHUNK): a context up to it runs in split 0 alone (no
    # merge); more changes which split sums what, so the bits may differ.
    min_chunk: int = SPLIT_MIN_TOKENS

    def __post_init__(self) -> None:
        if not 1 <= self.preload_tiles <= MAX_PRELOAD_TILES:
            raise ValueError(
                f"DecodeTiles: preload_tiles {self.preload_tiles} not in 1 … {MAX_PRELOAD_TILES}"
            )
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DecodeTiles: warps {self.warps} not a power of two up to 16")
        if self.min_chunk < 64 or self.min_chunk % 64:
            raise ValueError(f"DecodeTiles: min_chunk {self.min_chunk} not a positive multiple of 64 tokens")

    def launch(self, page: int) -> dict:
        """`_decode_kernel`'s tile constants and launch options at pages of `page` tokens."""
        return dict(
            BLOCK_N=max(64, page),
            PRELOAD_TILES=self.preload_tiles,
            MIN_CHUNK=self.min_chunk,
            num_warps=self.warps,
            num_stages=2,
        )


# `paged_decode`'s tiles unless given others: the first tile before the wait, 4 warps (as before
# PRELOAD_TILES), 8 at up to FEW_SEQS sequences. One H200, 2026-11-30 (bench/attention_decode_gpu.py
# --preload, one sequence, 128-384 tokens): 8 warps 4.57-6.23 µs a call against 4's 4.94-6.52 (Ling-mini
# and Ming-flash's TP=2 rank alike); the whole Ling-mini decode at c=1 and c=2 took it (bench/RESULTS.md).
DECODE_TILES = DecodeTiles()
FEW_SEQS = 2
FEW_SEQS_TILES = DecodeTiles(warps=8)


def default_tiles(bsz: int) -> DecodeTiles:
    """A decode launch's tiles when none are given: FEW_SEQS_TILES at up to FEW_SEQS sequences."""
    return FEW_SEQS_TILES if bsz <= FEW_SEQS else DECODE_TILES


# QK-norm + rope folded into the decode launch pays where each (sequence, KV head) runs in few
# splits: every split norms and ropes its query heads again before its first K load. One H200,
# 2026-11-29 (bench/attention_decode_gpu.py --qk-rope, graph-timed µs a call, its own launch →
# folded): 8 sequences (8 splits) 8.5 → 6.8 (128 tokens), 11.5 → 9.6 (512), 17.1 → 15.5 (2048) at
# Ming-flash TP=2, Ling-mini alike; 1 sequence (16 splits) 6.2 → 6.3, 9.1 → 9.8, 9.1 → 9.8: a loss.
QK_FOLD_MAX_SPLITS = 8


def folds_qk_rope(num_seqs: int, num_kv_heads: int, on_gpu: bool) -> bool:
    """Whether a decode launch of this shape takes QK-norm + rope in (`paged_decode(qk_rope=...)`)."""
    return launch_splits(num_seqs, num_kv_heads, on_gpu) <= QK_FOLD_MAX_SPLITS


def split_states(
    q: torch.Tensor, seqs_heads: int, splits: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A split launch's fp32 softmax states, one a (sequence, KV head, split): weighted values
    [states, rows, D] and (max, sum) [states, 2, rows], uninitialised (each split that holds tokens
    writes its group's real rows, and only those are read), and a ticket a (sequence, KV head).
    One split: none (the kernel reads none; q stands in)."""
    if splits == 1:
        return q, q, q
    states = seqs_heads * splits
    part = q.new_empty(states, rows, q.shape[-1], dtype=torch.float32)
    return part, q.new_empty(states, 2, rows, dtype=torch.float32), tickets_for(q.device, seqs_heads)


def _new_kv_operands(q: torch.Tensor, context_lens: torch.Tensor, new_kv: tuple | None) -> tuple:
    """The launch's new K/V operands (k, v, slots, then k's and v's token and head strides):
    `new_kv`'s, checked, or stand-ins the kernel never reads without WRITE_KV."""
    k, v, slots = new_kv if new_kv is not None else (q, q, context_lens)
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("paged_decode: the new K/V head dim must be contiguous")
    return k, v, slots, *k.stride()[:2], *v.stride()[:2]


def _qk_rope_operands(q: torch.Tensor, writes_kv: bool, qk_rope: tuple | None) -> tuple:
    """The launch's QK-norm + rope operands (q weight, k weight, cos, sin, eps, rotary dim, norm):
    `qk_rope`'s, checked, or stand-ins the kernel never reads and rotary dim 0 without it."""
    if qk_rope is None:
        return q, q, q, q, 0.0, 0, False
    q_w, k_w, eps, cos, sin = qk_rope
    rot = cos.shape[-1]
    if not writes_kv:
        raise ValueError("paged_decode: qk_rope needs new_kv (the new K is roped on its way into the cache)")
    if rot % 2 or not 0 < rot <= q.shape[-1]:
        raise ValueError(f"paged_decode: rotary dim {rot} must be even and in (0, {q.shape[-1]}]")
    cos, sin = cos.contiguous(), sin.contiguous()
    norm = q_w is not None
    return (q_w if norm else cos), (k_w if norm else cos), cos, sin, eps, rot, norm


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    splits: int | None = None,
    qk_rope: tuple[torch.Tensor | None, torch.Tensor | None, float, torch.Tensor, torch.Tensor] | None = None,
    tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one new token per sequence) → [B, H, D]: attention over each sequence's first
    context_lens[b] cached tokens through its block table row. `new_kv` = (k, v [B, KVH, D], slots
    [B]: each the context's last position): this launch writes them (as `write_kv`: slot < 0
    writes nothing). `splits` a (sequence, KV head): `launch_splits`'. `qk_rope` = (q_weight,
    k_weight (both or neither: no norm), eps, cos, sin [B, rotary_dim]): q and the new k are
    QK-normed and roped here, as `norms.qk_norm_rope` would (`norm_rope_heads`): each program on the
    query heads it loads, the one that writes the new K before storing it; q and k in memory stay.
    `tiles`: how each program reads (`default_tiles` unless given; the same bits at any preload)."""
    (bsz, num_heads, head_dim), (_, page, num_kv_heads, _) = q.shape, k_cache.shape
    group, group_pad = num_heads // num_kv_heads, max(16, triton.next_power_of_2(num_heads // num_kv_heads))
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    q_w, k_w, cos, sin, eps, rot, norm = _qk_rope_operands(q, new_kv is not None, qk_rope)
    splits = splits or launch_splits(bsz, num_kv_heads, q.is_cuda)
    _decode_kernel[(bsz, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        *split_states(q, bsz * num_kv_heads, splits, group_pad),
        scale,
        group,
        *paged_strides(q, out, block_tables, k_cache),
        *_new_kv_operands(q, context_lens, new_kv),
        q_w,
        k_w,
        cos,
        sin,
        cos.stride(0),
        eps,
        HEAD_DIM=head_dim,
        PAGE=page,
        GROUP_PAD=group_pad,
        GROUP_ROWS=triton.next_power_of_2(group),
        PRECISION=dot_precision(q.dtype),
        WRITE_KV=new_kv is not None,
        SPLITS=splits,
        ROT=rot,
        NORM=norm,
        **(tiles or default_tiles(bsz)).launch(page),
        **pdl.launch(q.device),
    )
    return out
