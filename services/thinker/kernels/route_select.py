"""The router's selection of a token's experts from its fp32 logits (`router._route_kernel`'s last
program, or at one token the streaming gate-up's programs, `moe_one_token.py`): sigmoid scores plus
the expert bias, the TOPK_GROUP groups with the best top-2 sums, then the TOP_K best experts of
those, each pick one reduction over packed (score, index) keys."""

from __future__ import annotations

import triton
import triton.language as tl

# Below every key: an entry taken out of the running.
_GONE = tl.constexpr(-0x7FFFFFFFFFFFFFFF)


@triton.jit
def _key(x, index, SPAN: tl.constexpr):
    """fp32 x and its index in [0, SPAN) as one int64 whose max is the largest x, ties to the lower
    index: one reduction finds both (the float's bits made order-preserving as a signed int)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (bits.to(tl.int64) << 32) | (-index.to(tl.int64) + (SPAN - 1))


@triton.jit
def _key_value(key):
    bits = (key >> 32).to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def expert_grid(NUM_EXPERTS: tl.constexpr, GROUPS: tl.constexpr):
    """[GROUPS, experts a group]: each expert's index, by group (the selection's view of a row)."""
    per_group: tl.constexpr = NUM_EXPERTS // GROUPS
    return tl.arange(0, GROUPS)[:, None] * per_group + tl.arange(0, per_group)[None, :]


@triton.jit
def load_logits(logit_rows, row_ok, NUM_EXPERTS: tl.constexpr, GROUPS: tl.constexpr):
    """The fp32 logits stored at `logit_rows` [BLOCK_T] in `expert_grid`'s view [BLOCK_T, GROUPS,
    experts a group], read past L1 (.cg: other programs or the launch before wrote them); rows not
    in `row_ok` zero."""
    return tl.load(
        logit_rows[:, None, None] + expert_grid(NUM_EXPERTS, GROUPS)[None, :, :],
        mask=row_ok[:, None, None],
        other=0.0,
        cache_modifier=".cg",
    )


@triton.jit
def choose_experts(
    logits,
    bias,
    NUM_EXPERTS: tl.constexpr,
    GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
):
    """The fp32 logits (`load_logits`) and the fp32 expert bias (`expert_grid`'s shape) → each row's
    expert ids [BLOCK_T, TOP_K] (int64), from registers: biased scores, the TOPK_GROUP groups with
    the best top-2 sums, then the TOP_K best experts of those (ties to the lower index). One
    reduction per pick (packed keys)."""
    per_group: tl.constexpr = NUM_EXPERTS // GROUPS
    rows: tl.constexpr = logits.shape[0]
    num_experts: tl.constexpr = NUM_EXPERTS
    g = tl.arange(0, GROUPS)
    j = tl.arange(0, per_group)
    biased = tl.sigmoid(logits.to(tl.float32)) + bias[None, :, :]
    # Each group's top-2 sum (the first maximum taken out once, ties kept).
    in_group = _key(biased, j[None, None, :], per_group)
    top1 = tl.max(in_group, axis=2)
    group_score = _key_value(top1)
    if per_group > 1:
        rest = tl.where(in_group == top1[:, :, None], _GONE, in_group)
        group_score += _key_value(tl.max(rest, axis=2))
    groups = _key(group_score, g[None, :], GROUPS)
    keep = tl.zeros((rows, GROUPS), dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        hit = groups == tl.max(groups, axis=1)[:, None]
        keep = keep | hit
        groups = tl.where(hit, _GONE, groups)
    e3 = (g[:, None] * per_group + j[None, :])[None, :, :]
    masked = _key(tl.where(keep[:, :, None], biased, float("-inf")), e3, num_experts)
    masked = tl.reshape(masked, (rows, num_experts))
    slot = tl.arange(0, TOP_K)
    chosen = tl.zeros((rows, TOP_K), dtype=tl.int64)
    for s in tl.static_range(TOP_K):
        best = tl.max(masked, axis=1)
        pick = -best.to(tl.int32) + (num_experts - 1)  # the low half is SPAN - 1 - index
        chosen = tl.where(slot[None, :] == s, pick[:, None].to(tl.int64), chosen)
        masked = tl.where(masked == best[:, None], _GONE, masked)
    return chosen


@triton.jit
def routing_weights(logit_rows, chosen, row_ok):
    """The rows' routing weights [BLOCK_T, TOP_K] before the scaling: the `chosen` experts'
    unbiased scores (sigmoid of the logits as stored at `logit_rows`, read again past L1),
    normalised."""
    picked = tl.load(logit_rows[:, None] + chosen, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
    w = tl.sigmoid(picked.to(tl.float32))
    return w / (tl.sum(w, axis=1)[:, None] + 1e-20)


@triton.jit
def select_experts(
    logit_rows,
    bias,
    row_ok,
    NUM_EXPERTS: tl.constexpr,
    GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
):
    """The fp32 logits stored at `logit_rows` [BLOCK_T] and the fp32 expert bias (`expert_grid`'s
    shape) → each row's routing (weights [BLOCK_T, TOP_K] before the scaling, expert ids; rows not
    in `row_ok` unread): `choose_experts` over `load_logits`, weighted by `routing_weights`. A
    launch that needs the ids before the weights (the gate-up that selects, kernels/moe_one_token.py)
    calls the three itself: the same ops, the same bits."""
    logits = load_logits(logit_rows, row_ok, NUM_EXPERTS, GROUPS)
    chosen = choose_experts(logits, bias, NUM_EXPERTS, GROUPS, TOPK_GROUP, TOP_K)
    return routing_weights(logit_rows, chosen, row_ok), chosen
