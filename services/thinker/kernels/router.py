"""The sigmoid group-limited top-k router's selection in one launch (the reference takes ~15)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_topk_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    stride_l,
    scaling,
    NUM_EXPERTS: tl.constexpr,
    GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    per_group: tl.constexpr = NUM_EXPERTS // GROUPS
    g = tl.arange(0, GROUPS)
    j = tl.arange(0, per_group)
    e2 = g[:, None] * per_group + j[None, :]
    scores = tl.sigmoid(tl.load(logits_ptr + t * stride_l + e2).to(tl.float32))
    biased = scores + tl.load(bias_ptr + e2).to(tl.float32)
    # Each group's top-2 sum (the first maximum taken out once, ties kept).
    top1 = tl.max(biased, axis=1)
    first = tl.min(tl.where(biased == top1[:, None], j[None, :], per_group), axis=1)
    rest = tl.where(j[None, :] == first[:, None], float("-inf"), biased)
    group_score = top1 + tl.max(rest, axis=1)
    keep = tl.zeros((GROUPS,), dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(group_score, axis=0)
        pick = tl.min(tl.where(group_score == best, g, GROUPS), axis=0)
        keep = keep | (g == pick)
        group_score = tl.where(g == pick, float("-inf"), group_score)
    masked = tl.where(keep[:, None], biased, float("-inf"))
    chosen_w = tl.zeros((TOP_K,), dtype=tl.float32)
    chosen_id = tl.zeros((TOP_K,), dtype=tl.int64)
    slot = tl.arange(0, TOP_K)
    for s in tl.static_range(TOP_K):
        best = tl.max(tl.max(masked, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(masked == best, e2, NUM_EXPERTS), axis=1), axis=0)
        w = tl.sum(tl.sum(tl.where(e2 == pick, scores, 0.0), axis=1), axis=0)
        chosen_w = tl.where(slot == s, w, chosen_w)
        chosen_id = tl.where(slot == s, pick.to(tl.int64), chosen_id)
        masked = tl.where(e2 == pick, float("-inf"), masked)
    chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20) * scaling
    tl.store(weights_ptr + t * TOP_K + slot, chosen_w)
    tl.store(ids_ptr + t * TOP_K + slot, chosen_id)


def grouped_topk_route(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [T, E] → (fp32 weights [T, top_k], int64 expert ids [T, top_k])."""
    t, num_experts = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        logits = logits.contiguous()
        _grouped_topk_kernel[(t,)](
            logits,
            bias,
            weights,
            ids,
            logits.stride(0),
            scaling,
            NUM_EXPERTS=num_experts,
            GROUPS=n_group,
            TOPK_GROUP=topk_group,
            TOP_K=top_k,
        )
    return weights, ids


def route_shapes_supported(num_experts: int, n_group: int, top_k: int) -> bool:
    """tl.arange needs powers of two: the experts per group, the groups and top_k."""
    per_group = num_experts // n_group

    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    return num_experts % n_group == 0 and pow2(per_group) and pow2(n_group) and pow2(top_k)
