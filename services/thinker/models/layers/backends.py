"""The kernel seam: which code runs the thinker's attention and routed experts."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omnistage.common.config import ATTENTION_BACKENDS, MOE_BACKENDS
from omnistage.services.thinker.kernels import triton_available
from omnistage.services.thinker.models.layers.attention import (
    TORCH_ATTENTION,
    AttentionMetadata,
    PagedAttention,
    gather_context,
)
from omnistage.services.thinker.models.layers.moe import FusedExperts, GatedMLP, Router
from omnistage.services.thinker.models.layers.norm import RMSNorm
from torch import nn


class BackendError(ValueError):
    """The asked backend cannot run here (says why and what would)."""


@dataclass(frozen=True)
class Backends:
    """What the model runs on; `graph_safe` when a decode step can be captured as a CUDA graph."""

    attention: str
    moe: str

    @property
    def graph_safe(self) -> bool:
        return self.attention == "triton" and self.moe == "triton"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backends(
    attention: str, moe: str, device: torch.device, block_size: int, head_dim: int
) -> Backends:
    """`auto` → triton on CUDA when triton imports (and the shapes suit the kernels), else torch."""
    if attention not in ATTENTION_BACKENDS:
        raise BackendError(
            f"attention backend {attention!r}: expected one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if moe not in MOE_BACKENDS:
        raise BackendError(f"moe backend {moe!r}: expected one of {', '.join(MOE_BACKENDS)}")
    runs_triton = triton_available() and (device.type == "cuda" or _interpreting())
    shapes_ok = block_size >= 16 and _pow2(block_size) and head_dim >= 16 and _pow2(head_dim)

    def pick(name: str, what: str, needs_shapes: bool) -> str:
        if name == "auto":
            return (
                "triton"
                if runs_triton and device.type == "cuda" and (shapes_ok or not needs_shapes)
                else "torch"
            )
        if name == "triton" and not runs_triton:
            raise BackendError(
                f"{what}_backend triton needs a CUDA device and the triton package (device {device})"
            )
        if name == "triton" and needs_shapes and not shapes_ok:
            raise BackendError(
                f"attention_backend triton needs block_size >= 16 and head_dim >= 16, both powers of two "
                f"(block_size {block_size}, head_dim {head_dim})"
            )
        return name

    return Backends(pick(attention, "attention", True), pick(moe, "moe", False))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def install_backends(model: nn.Module, backends: Backends) -> None:
    """Point every layer of `model` at the chosen kernels (None everywhere: the reference).

    attention triton: paged attention + KV writes, and the element-wise work around it (RMSNorm with
    its residual add, QK-norm + rope, SiLU·mul of the dense and shared-expert MLPs) one launch each.
    moe triton: the router's group-limited top-k and the routed experts."""
    attention, norm, qk, act = TORCH_ATTENTION, None, None, None
    if backends.attention == "triton":
        from omnistage.services.thinker.kernels import norms

        attention, norm, qk, act = TritonAttention(), norms.rms_norm, norms.qk_norm_rope, norms.silu_and_mul
    experts, route = None, None
    if backends.moe == "triton":
        from omnistage.services.thinker.kernels.fused_moe import align_supported, fused_experts
        from omnistage.services.thinker.kernels.router import grouped_topk_route, route_shapes_supported

        experts = fused_experts
        route = grouped_topk_route
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.backend = attention
        elif isinstance(module, RMSNorm):
            module.kernel = norm
        elif hasattr(module, "qk_kernel"):  # a model's attention block (QK-norm + rope on qkv rows)
            module.qk_kernel = qk
        elif isinstance(module, GatedMLP):
            module.act = act
        elif isinstance(module, FusedExperts):
            module.kernel = experts if experts is None or align_supported(module.w13.shape[0]) else None
        elif isinstance(module, Router):
            e, groups, k = module.weight.shape[0], module.n_group, module.top_k
            module.kernel = route if route is None or route_shapes_supported(e, groups, k) else None


class TritonAttention:
    """KV writes and decode steps in Triton (lengths from `context_lens_tensor`: graph-safe);
    prefill chunks of a mixed step through SDPA, one sequence at a time."""

    def __init__(self) -> None:
        from omnistage.services.thinker.kernels import paged_attention

        self.kernels = paged_attention

    def forward(
        self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        if md.slot_mapping is None or not layer.has_cache:
            return TORCH_ATTENTION.forward(layer, q, k, v, md)
        self.kernels.write_kv(k, v, layer.k_cache, layer.v_cache, md.slot_mapping)
        if md.is_decode:
            lens = md.context_lens_tensor
            if lens is None:
                lens = torch.tensor(md.context_lens, dtype=torch.int32, device=q.device)
            return self.kernels.paged_decode(
                q, layer.k_cache, layer.v_cache, md.block_tables, lens, layer.scale
            )
        out = torch.empty_like(q)
        start = 0
        for i, (qlen, ctx) in enumerate(zip(md.query_lens, md.context_lens, strict=True)):
            if qlen == 0:
                continue
            ki, vi = gather_context(layer, md.block_tables[i], ctx)
            out[start : start + qlen] = _sdpa(layer, q[start : start + qlen], ki, vi, ctx - qlen)
            start += qlen
        return out


def _sdpa(
    layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int
) -> torch.Tensor:
    """Causal attention of q (positions offset..) over k/v [ctx, KVH, D] through SDPA's fused kernels."""
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if offset == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=layer.scale, enable_gqa=True)
    else:
        qpos = torch.arange(q.shape[0], device=q.device)[:, None] + offset
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= qpos
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=layer.scale, enable_gqa=True)
    return out[0].transpose(0, 1)
