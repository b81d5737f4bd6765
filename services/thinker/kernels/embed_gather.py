"""A step's token rows [T, H] from the vocab-parallel embedding in one launch.

At the start of a decode step of one sequence every kernel is on the critical path, and the torch
path from staged ids to rows was ~6 small launches of ~2 µs each: the placeholders' resolution
(neg, clamp, index, where: async scheduling's ids of the step before, `SampledFeed`), the clamp
into the vocabulary, the gather, and under TP the shard mask (compare, where, multiply). Here one
launch does all of it: for token t, id = ids[t]; a placeholder (row r's is -r - 1) takes
sampled[clamp(-id - 1, 0, S - 1)]; id = clamp(id, 0, vocab_size - 1); the row is
weight[id - start] where this rank's shard [start, end) holds id, else zeros. A pure gather: the
rows are the torch path's (`embed_head.embed_reference`, the CPU path and the fallback) value for
value (its masked rows may be -0.0 where these are +0.0; the TP all-reduce adds the owner's row to
them either way). Splicing multimodal rows stays with the caller (an index_copy after this).

Launched with PDL, waiting first: the ids and the sampled ids are written by the copy and the
kernels just before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import interpreting, pdl
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels

BLOCK_H = 1024  # columns a program: 16-byte loads of bf16 (fp32: 4 programs a row of 4096)
ID_DTYPES = (torch.int32, torch.int64)


def chooses_kernel(ids: torch.Tensor, weight: torch.Tensor, sampled: torch.Tensor | None = None) -> bool:
    """The one dispatch rule: 1-D contiguous int32/int64 ids (and sampled ids, at least one), a
    contiguous 2-D weight on the ids' device, on CUDA (or anywhere under TRITON_INTERPRET=1)."""
    ids_ok = ids.dim() == 1 and ids.dtype in ID_DTYPES and ids.is_contiguous()
    feed_ok = sampled is None or (
        sampled.dim() == 1
        and sampled.numel() > 0
        and sampled.dtype in ID_DTYPES
        and sampled.is_contiguous()
        and sampled.device == ids.device
    )
    return (
        ids_ok
        and feed_ok
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.device == ids.device
        and (ids.is_cuda or interpreting())
    )


@triton.jit(do_not_specialize=["feed_len"])
def _embed_gather_kernel(
    ids_ptr,
    feed_ptr,
    weight_ptr,
    out_ptr,
    feed_len,
    vocab_size,
    start,
    end,
    hidden,
    HAS_FEED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, j): columns [j * BLOCK_H, (j + 1) * BLOCK_H) of token t's row."""
    wait_for_prior_kernels(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token = tl.load(ids_ptr + t).to(tl.int64)
    if HAS_FEED:
        slot = tl.minimum(tl.maximum(-token - 1, 0), feed_len - 1)
        named = tl.load(feed_ptr + slot, mask=token < 0, other=0).to(tl.int64)
        token = tl.where(token < 0, named, token)
    token = tl.minimum(tl.maximum(token, 0), vocab_size - 1)
    mine = (token >= start) & (token < end)
    row = tl.where(mine, token - start, 0)
    read = tl.where(mine, hidden, 0)  # the columns to load: none outside the shard (zeros)
    values = tl.load(weight_ptr + row * hidden + col, mask=col < read, other=0)
    tl.store(out_ptr + t * hidden + col, values, mask=col < hidden)


def rows(
    ids: torch.Tensor,
    weight: torch.Tensor,
    vocab_size: int,
    start: int,
    end: int,
    sampled: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Rows [T, H] (the weight's dtype) of ids [T] from this rank's shard `weight` [rows, H] of the
    vocabulary [start, end) (zeros for an id outside it); placeholders name `sampled` [S]. One
    launch (none for T = 0) where `chooses_kernel` says so; None elsewhere (the caller's torch path
    serves)."""
    if not chooses_kernel(ids, weight, sampled):
        return None
    num_tokens, hidden = ids.shape[0], weight.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=weight.dtype, device=weight.device)
    if num_tokens == 0 or hidden == 0:
        return out
    block = min(BLOCK_H, triton.next_power_of_2(hidden))
    _embed_gather_kernel[(num_tokens, triton.cdiv(hidden, block))](
        ids,
        ids if sampled is None else sampled,  # unread without a feed
        weight,
        out,
        1 if sampled is None else sampled.numel(),
        vocab_size,
        start,
        end,
        hidden,
        HAS_FEED=sampled is not None,
        BLOCK_H=block,
        **pdl.launch(weight.device),
    )
    return out
