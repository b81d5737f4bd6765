"""Paged causal attention over a block-table KV cache: the step's metadata, the layer, the QK-norm +
rope its q and k may still need (`QKNormRope`), and the PyTorch reference kernel (the CPU path and
the oracle of the fast backends in `backends.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from omnistage.services.thinker.models.layers.norm import rms_norm_reference
from omnistage.services.thinker.models.layers.rotary import apply_rope
from torch import nn


@dataclass
class AttentionMetadata:
    """One forward step's attention layout (built by the model runner, read by every layer)."""

    # New tokens per sequence, in flattened order; they sum to the step's token count.
    query_lens: list[int]
    # Tokens of each sequence in the cache after this step's writes (cached prefix + new tokens).
    context_lens: list[int]
    # [num_tokens] int64 cache slot of each new token (block_id * block_size + offset); None: no cache.
    slot_mapping: torch.Tensor | None = None
    # [num_seqs, max_blocks] int64 block ids per sequence (-1 padded); None: no cache.
    block_tables: torch.Tensor | None = None
    # [num_seqs] context_lens on the device, for kernels that read lengths there (decode graphs).
    context_lens_tensor: torch.Tensor | None = None
    # block_tables on the host, for backends that plan a step there (FlashInfer); None: not given.
    host_block_tables: torch.Tensor | None = None
    # What a backend derives once per step and every layer reuses (a kernel's tile table, a FlashInfer
    # plan), keyed by the backend; it lives as long as the step's metadata.
    step_state: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.query_lens) != len(self.context_lens):
            raise ValueError("query_lens and context_lens differ in length")
        for q, c in zip(self.query_lens, self.context_lens, strict=True):
            if q < 0 or c < q:
                raise ValueError(f"bad lengths: query {q} > context {c}")

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (a pure decode step)."""
        return all(q == 1 for q in self.query_lens)

    @classmethod
    def no_cache(cls, query_lens: list[int]) -> AttentionMetadata:
        """Each sequence attends only to its own tokens (a full prompt with nothing cached)."""
        return cls(query_lens=list(query_lens), context_lens=list(query_lens))


_CURRENT: AttentionMetadata | None = None


@contextlib.contextmanager
def attention_metadata(md: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Install the step's metadata for the duration of one forward; nesting is a bug."""
    global _CURRENT
    if _CURRENT is not None:
        raise RuntimeError("attention metadata is already set: forwards must not nest")
    _CURRENT = md
    try:
        yield md
    finally:
        _CURRENT = None


def current_metadata(num_tokens: int) -> AttentionMetadata:
    """The installed metadata, or a single no-cache sequence of `num_tokens` when none is set."""
    return _CURRENT if _CURRENT is not None else AttentionMetadata.no_cache([num_tokens])


class QKNormRope(NamedTuple):
    """The per-head RMSNorm (q_weight / k_weight [D], both or neither: no norm) and the partial NeoX
    rope (cos / sin [T, rotary_dim] of the step's tokens) that a layer's q and k take before
    attention. The model hands them to `PagedAttention.forward` with the raw q and k, and the
    backend applies them: the reference as `reference` does, a fast backend in a launch of its own
    or folded into its decode attention launch (`backends.TritonAttention`). Where the backend
    would launch them apart (`PagedAttention.qk_rope_apart`) the qkv projection's launch may apply
    them instead, and the model then hands q and k over normed and roped, without them. A tuple in
    the order `kernels.norms.qk_norm_rope` and `paged_decode` take it."""

    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor

    def reference(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D] normed and roped as the reference's modules do (new tensors)."""
        if self.q_weight is not None:
            q, k = (
                rms_norm_reference(q, self.q_weight, self.eps),
                rms_norm_reference(k, self.k_weight, self.eps),
            )
        return apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)


class AttentionBackend(Protocol):
    """How one layer's attention runs (the deploy file picks: `backends.py`); `qk_rope` given: q and
    k are raw, and the backend norms and ropes them (K before it enters the cache)."""

    def forward(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        md: AttentionMetadata,
        qk_rope: QKNormRope | None = None,
    ) -> torch.Tensor: ...

    def qk_rope_apart(self, layer: PagedAttention, num_tokens: int, md: AttentionMetadata) -> bool:
        """Whether, given `qk_rope`, this step's forward would apply it in a launch of its own
        (`norms.qk_norm_rope`) -- a launch before the attention may then take it on instead."""
        ...


class PagedAttention(nn.Module):
    """Attention of one layer over its slice of heads; holds that layer's KV cache views.

    `k_cache`/`v_cache` are [num_blocks, block_size, num_kv_heads, head_dim] views assigned by the
    model runner; empty tensors until then. `backend` runs it (the reference unless one is installed).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend: AttentionBackend = TORCH_ATTENTION

    @property
    def has_cache(self) -> bool:
        return self.k_cache.numel() > 0

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_rope: QKNormRope | None = None
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] → [T, H, D]; with `qk_rope` q and k are taken raw and normed
        and roped here first (by the backend, which may fold it into its attention launch; q and k
        themselves may be left raw or changed in place: the caller reads neither afterwards)."""
        return self.backend.forward(self, q, k, v, current_metadata(q.shape[0]), qk_rope)

    def qk_rope_apart(self, num_tokens: int) -> bool:
        """Whether this step's backend would QK-norm and rope q and k in a launch of its own (the qkv
        projection may then do it in its launch, and hand q and k over without `qk_rope`)."""
        return self.backend.qk_rope_apart(self, num_tokens, current_metadata(num_tokens))


class TorchAttention:
    """The reference: QK-norm + rope (`QKNormRope.reference`), K/V written with index_copy_, then
    each sequence attends in fp32 on its own."""

    def forward(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        md: AttentionMetadata,
        qk_rope: QKNormRope | None = None,
    ) -> torch.Tensor:
        if qk_rope is not None:
            q, k = qk_rope.reference(q, k)
        use_cache = md.slot_mapping is not None and layer.has_cache
        if use_cache:
            write_kv_reference(layer, k, v, md.slot_mapping)
        out = torch.empty_like(q)
        start = 0
        for i, (qlen, ctx) in enumerate(zip(md.query_lens, md.context_lens, strict=True)):
            if qlen == 0:
                continue
            qi = q[start : start + qlen]
            if use_cache:
                ki, vi = gather_context(layer, md.block_tables[i], ctx)
            else:
                ki, vi = k[start : start + qlen], v[start : start + qlen]
            out[start : start + qlen] = attend_reference(layer, qi, ki, vi, ctx - qlen)
            start += qlen
        return out

    def qk_rope_apart(self, layer: PagedAttention, num_tokens: int, md: AttentionMetadata) -> bool:
        """Never: the reference applies it by its modules' ops (the CPU oracle stays whole)."""
        return False


def write_kv_reference(layer: PagedAttention, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """K/V rows into the cache at `slots`; a slot < 0 (a padding row of a decode graph) is skipped."""
    flat_k = layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim)
    flat_v = layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim)
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, v.to(flat_v.dtype))


def gather_context(layer: PagedAttention, table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `ctx` cached K/V rows [ctx, KVH, D] of one sequence, through its block table row."""
    block_size = layer.k_cache.shape[1]
    blocks = table[: (ctx + block_size - 1) // block_size]
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).flatten()[:ctx]
    flat_k = layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim)
    flat_v = layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim)
    return flat_k.index_select(0, slots), flat_v.index_select(0, slots)


def attend_reference(
    layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int
) -> torch.Tensor:
    """Causal attention of q (positions offset..offset+len-1) over k/v (positions 0..ctx-1), in fp32."""
    groups = layer.num_heads // layer.num_kv_heads
    qh = q.transpose(0, 1)  # [H, q, D]
    kh = k.transpose(0, 1).repeat_interleave(groups, dim=0)  # [H, ctx, D]
    vh = v.transpose(0, 1).repeat_interleave(groups, dim=0)
    scores = torch.matmul(qh.float(), kh.float().transpose(1, 2)) * layer.scale
    qpos = torch.arange(q.shape[0], device=q.device)[:, None] + offset
    kpos = torch.arange(k.shape[0], device=q.device)[None, :]
    scores.masked_fill_(kpos > qpos, float("-inf"))
    probs = F.softmax(scores, dim=-1)
    return torch.matmul(probs, vh.float()).to(q.dtype).transpose(0, 1)


TORCH_ATTENTION = TorchAttention()
