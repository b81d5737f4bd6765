"""Paged attention of a whole prefill or mixed step in one Triton launch (varlen over the paged KV).

Every sequence of the step — a prompt chunk over its cached prefix, or a decode row — is cut into
tiles of `block_q` query tokens; one program takes one tile and one KV head, with that head's GQA
group of query heads packed as rows (`block_q × group` rows share each K/V load), and walks the
sequence's cache through its block-table row, causally: query token t of a chunk that starts at
position p attends to keys 0..p+t. The tile table (`prefill_tiles`) is made on the host once per
step and read by every layer; lengths never reach the kernel as specialised ints, so one compiled
kernel serves every prompt length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import dot_precision
from omnistage.services.thinker.kernels.paged_attention import load_kv, paged_strides
from omnistage.services.thinker.kernels.tile_table import TILE_FIELDS, prefill_tile_rows

# Rows (query tokens x GQA heads) of one program: the tile of a prompt of any length.
BLOCK_M = 64
BLOCK_N = 64
_LOG2E = 1.4426950408889634


def tile_tokens(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per tile: BLOCK_M rows over the padded GQA group."""
    return max(1, BLOCK_M // triton.next_power_of_2(num_heads // num_kv_heads))


def prefill_tiles(query_lens: list[int], context_lens: list[int], block_q: int) -> torch.Tensor:
    """[tiles, 5] int32 host table (`tile_table.prefill_tile_rows`)."""
    rows = prefill_tile_rows(query_lens, context_lens, block_q)
    return torch.tensor(rows, dtype=torch.int32).view(-1, TILE_FIELDS)


@triton.jit
def _online_softmax_step(q, k, v, allowed, m, s, acc, scale_log2, PRECISION: tl.constexpr):
    """One key block of the online softmax (base 2): the running max, sum and output rows updated.
    Key 0 is in every row's first block (its query position is >= 0), so m is finite from then on."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    s = s * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, s, acc


@triton.jit
def _tile_rows(tiles_ptr, group, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr):
    """This program's tile: its sequence, the flattened token row of each of its BLOCK_Q x GROUP_PAD
    rows, each row's GQA head within the group, which rows are real, each row's cache position, and
    the end of the keys the tile sees (its last query sits at pos0 + n - 1)."""
    tile = tiles_ptr + tl.program_id(0) * 5
    seq = tl.load(tile).to(tl.int64)
    row0 = tl.load(tile + 1).to(tl.int64)
    n = tl.load(tile + 2)
    pos0 = tl.load(tile + 3)
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = r // GROUP_PAD
    g = r % GROUP_PAD
    return seq, (row0 + tok).to(tl.int64), g, (tok < n) & (g < group), pos0 + tok, pos0 + n


@triton.jit(do_not_specialize=["stride_tb"])  # the step's block-table width: one compile
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    tiles_ptr,
    out_ptr,
    scale_log2,
    group,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_tb,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (tile, KV head): BLOCK_Q tokens x GROUP_PAD heads over the causal keys, online softmax in
    fp32 (base 2, the scale folded into the exponent)."""
    kvh = tl.program_id(1)
    seq, q_rows, g, row_ok, qpos, end = _tile_rows(tiles_ptr, group, GROUP_PAD, BLOCK_Q)
    head = kvh * group + g
    d = tl.arange(0, HEAD_DIM)
    q_off = q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    m = tl.full((BLOCK_Q * GROUP_PAD,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_Q * GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q * GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    table = tables_ptr + seq * stride_tb
    for start in range(0, end, BLOCK_KV):
        kt = start + tl.arange(0, BLOCK_KV)
        k_ok = kt < end
        k, v = load_kv(
            k_cache_ptr, v_cache_ptr, table, kt, k_ok, kvh, d, stride_cb, stride_cs, stride_ch, PAGE
        )
        allowed = (kt[None, :] <= qpos[:, None]) & k_ok[None, :]
        m, s, acc = _online_softmax_step(q, k, v, allowed, m, s, acc, scale_log2, PRECISION)
    out = acc / tl.maximum(s, 1e-30)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    zero_rows: bool = False,
) -> torch.Tensor:
    """q [T, H, D] (the step's new tokens, sequence by sequence, their K/V already written) → [T, H, D]:
    causal attention of each token over its sequence's cache, through `tiles` (`prefill_tiles`, on
    q's device) and the block tables [S, W]. `zero_rows`: rows no tile covers are zeros (a prefill
    graph's padding tokens; else they are left unwritten). Tiles of 0 tokens do nothing."""
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q) if zero_rows else torch.empty_like(q)
    if num_tokens == 0 or tiles.shape[0] == 0:
        return out
    _prefill_kernel[(tiles.shape[0], num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        tiles,
        out,
        scale * _LOG2E,
        group,
        *paged_strides(q, out, block_tables, k_cache),
        HEAD_DIM=head_dim,
        PAGE=page,
        GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_Q=tile_tokens(num_heads, num_kv_heads),
        BLOCK_KV=max(BLOCK_N, page),
        PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    return out
