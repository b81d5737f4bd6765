"""Paged KV writes and paged decode attention in Triton, with every length read on the device."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import dot_precision


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
def load_kv(
    k_cache_ptr, v_cache_ptr, table, tok, tok_ok, kvh, d, stride_cb, stride_cs, stride_ch, PAGE: tl.constexpr
):
    """K and V rows [len(tok), len(d)] of KV head `kvh` at the cached positions `tok` (zeros where not
    `tok_ok`), through the sequence's block-table row `table`; both paged kernels read the cache so."""
    block = tl.load(table + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)
    kv_off = block[:, None] * stride_cb + (tok % PAGE)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=tok_ok[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=tok_ok[:, None], other=0.0)
    return k, v


@triton.jit
def _attend_pages(
    q,
    k_cache_ptr,
    v_cache_ptr,
    table,
    ctx,
    kvh,
    stride_cb,
    stride_cs,
    stride_ch,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """q [GROUP_PAD, D] over one sequence's first `ctx` cached tokens of KV head `kvh` (`table`: its
    block-table row), BLOCK_N tokens per iteration, online softmax in fp32 → [GROUP_PAD, D]."""
    d = tl.arange(0, q.shape[1])
    m = tl.full((q.shape[0],), float("-inf"), dtype=tl.float32)
    s = tl.zeros((q.shape[0],), dtype=tl.float32)
    acc = tl.zeros(q.shape, dtype=tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for start in range(0, ctx, BLOCK_N):
        tok = start + offs
        tok_ok = tok < ctx
        k, v = load_kv(
            k_cache_ptr, v_cache_ptr, table, tok, tok_ok, kvh, d, stride_cb, stride_cs, stride_ch, PAGE
        )
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        s = s * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return acc / tl.maximum(s, 1e-30)[:, None]


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    ctx_ptr,
    out_ptr,
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
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    WRITE_KV: tl.constexpr,
):
    """One (sequence, KV head): its GQA group of query heads over BLOCK_N cached tokens (several
    pages) per iteration, online softmax in fp32. WRITE_KV: the new token's K/V row of this head
    is first stored at its slot (slot < 0: nothing) by this program, the only one that reads it."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    heads = kvh * group + tl.arange(0, GROUP_PAD)
    h_ok = tl.arange(0, GROUP_PAD) < group
    d = tl.arange(0, HEAD_DIM)
    if WRITE_KV:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        if slot >= 0:
            row = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kvh * stride_ch + d
            tl.store(k_cache_ptr + row, tl.load(k_ptr + b * stride_kt + kvh * stride_kh + d))
            tl.store(v_cache_ptr + row, tl.load(v_ptr + b * stride_vt + kvh * stride_vh + d))
        tl.debug_barrier()  # the row stored before any thread of this program reads the cache
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=h_ok[:, None], other=0.0
    )
    q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)
    table, kv = tables_ptr + b * stride_tb, (k_cache_ptr, v_cache_ptr)
    out = _attend_pages(q, *kv, table, ctx, kvh, stride_cb, stride_cs, stride_ch, PAGE, BLOCK_N, PRECISION)
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None],
    )


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


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one new token per sequence) → [B, H, D]: attention over each sequence's first
    context_lens[b] cached tokens through its block table row. The new tokens' K/V are in the
    cache already, or `new_kv` = (k, v [B, KVH, D], slots [B]) and this launch writes them (as
    `write_kv` would: slot < 0 writes nothing), one launch fewer per layer."""
    bsz, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    k, v, slots = new_kv if new_kv is not None else (q, q, context_lens)  # unread without WRITE_KV
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("paged_decode: the new K/V head dim must be contiguous")
    _decode_kernel[(bsz, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        scale,
        group,
        *paged_strides(q, out, block_tables, k_cache),
        k,
        v,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEAD_DIM=head_dim,
        PAGE=page,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=max(64, page),
        PRECISION=dot_precision(q.dtype),
        WRITE_KV=new_kv is not None,
        num_warps=4,
        num_stages=2,
    )
    return out
