"""The sigmoid group-limited top-k router in Triton: the gate GEMV and the selection in one launch
for a decode step's few tokens, the same kernel's selection alone over cuBLAS logits for a prefill.

The reference (`layers/moe.py` Router) takes ~15 launches, and its fp32 GEMV two more copies (the
activations and the gate weight cast to fp32 every step). The fused kernel reads both in their own
dtype and accumulates in fp32, as the reference's fp32 GEMV does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Up to this many tokens the gate GEMV runs in the fused launch: every program re-reads its slice of
# the gate weight per token block, so it grows with the tokens (one H200, Ling-mini's gate: 5.8 µs a
# launch at 1 token, 20.7 at 8, 43 at 32), while cuBLAS's GEMV + the select-only launch stay ~12 µs.
FUSED_MAX_TOKENS = 4
# Products each fused program holds at once (BLOCK_T x BLOCK_E x BLOCK_H fp32): the hidden chunk
# shrinks as the token block grows, so the registers stay bounded.
_TILE_ELEMS = 8192
_BLOCK_E = 4


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
def _select(
    logit_rows,
    bias_ptr,
    row_ok,
    NUM_EXPERTS: tl.constexpr,
    GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
):
    """The fp32 logits stored at `logit_rows` [BLOCK_T] → each row's routing (weights [BLOCK_T,
    TOP_K] before the scaling, expert ids; rows not in `row_ok` unread): biased scores, the
    TOPK_GROUP groups with the best top-2 sums, then the TOP_K best experts of those (ties to the
    lower index) weighted by their unbiased scores, normalised. One reduction per pick (packed
    keys); logits read past L1 (.cg: other programs wrote them)."""
    per_group: tl.constexpr = NUM_EXPERTS // GROUPS
    e2 = tl.arange(0, GROUPS)[:, None] * per_group + tl.arange(0, per_group)[None, :]
    logits = tl.load(
        logit_rows[:, None, None] + e2[None, :, :],
        mask=row_ok[:, None, None],
        other=0.0,
        cache_modifier=".cg",
    )
    bias = tl.load(bias_ptr + e2).to(tl.float32)
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
    keep = tl.zeros((row_ok.shape[0], GROUPS), dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        hit = groups == tl.max(groups, axis=1)[:, None]
        keep = keep | hit
        groups = tl.where(hit, _GONE, groups)
    e3 = (g[:, None] * per_group + j[None, :])[None, :, :]
    masked = _key(tl.where(keep[:, :, None], biased, float("-inf")), e3, num_experts)
    masked = tl.reshape(masked, (row_ok.shape[0], num_experts))
    slot = tl.arange(0, TOP_K)
    chosen = tl.zeros((row_ok.shape[0], TOP_K), dtype=tl.int64)
    for s in tl.static_range(TOP_K):
        best = tl.max(masked, axis=1)
        pick = -best.to(tl.int32) + (num_experts - 1)  # the low half is SPAN - 1 - index
        chosen = tl.where(slot[None, :] == s, pick[:, None].to(tl.int64), chosen)
        masked = tl.where(masked == best[:, None], _GONE, masked)
    # The unbiased scores of the picks, from the logits as stored.
    picked = tl.load(logit_rows[:, None] + chosen, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
    w = tl.sigmoid(picked.to(tl.float32))
    return w / (tl.sum(w, axis=1)[:, None] + 1e-20), chosen


@triton.jit
def _gate_gemv(x_ptr, w_ptr, rows, row_ok, experts, hidden, stride_x, stride_w, BLOCK_H: tl.constexpr):
    """[len(rows), len(experts)] fp32 logits: the rows' activations times the experts' gate rows,
    both loaded in their own dtype, products and sums in fp32 (the reference's fp32 GEMV)."""
    hs = tl.arange(0, BLOCK_H)
    acc = tl.zeros((row_ok.shape[0], experts.shape[0]), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h_ok = hs < hidden - h0
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + h0 + hs[None, :],
            mask=row_ok[:, None] & h_ok[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + experts[:, None] * stride_w + h0 + hs[None, :], mask=h_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    logits_ptr,
    tickets_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    hidden,
    stride_x,
    stride_w,
    scaling,
    NUM_EXPERTS: tl.constexpr,
    GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GEMV: tl.constexpr,
):
    """Program (e, t) for BLOCK_T tokens. GEMV: the fp32 logits of BLOCK_E experts into `logits`;
    the last program of a token block to finish (a ticket per block, taken atomically and reset by
    that program, so the buffer is zero again for the next launch) selects the experts of its
    tokens from all logits. Else the logits [T, E] are given (x, w and the tickets unread) and
    program (0, t) selects."""
    pid_t = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    row_ok = rows < num_tokens
    last = True
    if GEMV:
        experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        acc = _gate_gemv(x_ptr, w_ptr, rows, row_ok, experts, hidden, stride_x, stride_w, BLOCK_H)
        tl.store(logits_ptr + rows[:, None] * NUM_EXPERTS + experts[None, :], acc, mask=row_ok[:, None])
        tl.debug_barrier()  # every thread's logits stored before the ticket releases them
        done = tl.atomic_add(tickets_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        last = done == tl.num_programs(0) - 1
        if last:
            tl.store(tickets_ptr + pid_t, 0)
    if last:
        w, chosen = _select(
            logits_ptr + rows * NUM_EXPERTS, bias_ptr, row_ok, NUM_EXPERTS, GROUPS, TOPK_GROUP, TOP_K
        )
        out = rows[:, None] * TOP_K + tl.arange(0, TOP_K)[None, :]
        tl.store(weights_ptr + out, w * scaling, mask=row_ok[:, None])
        tl.store(ids_ptr + out, chosen, mask=row_ok[:, None])


_tickets: dict[torch.device, torch.Tensor] = {}


def _tickets_for(device: torch.device, blocks: int) -> torch.Tensor:
    """The zeroed ticket counters of `device` (each launch leaves them zero); made once, outside
    any graph capture in practice (the eager warm-up forward runs first)."""
    buf = _tickets.get(device)
    if buf is None or buf.numel() < blocks:
        buf = _tickets[device] = torch.zeros(max(blocks, 64), dtype=torch.int32, device=device)
    return buf


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    scaling: float,
    fuse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], gate weight [E, H] → (fp32 weights [T, top_k], int64 expert ids [T, top_k]).

    One launch up to FUSED_MAX_TOKENS tokens (and `fuse`); otherwise the reference's fp32 GEMV
    (cuBLAS, a prefill's many tokens), then the selection in one launch, a program a token."""
    t, hidden = x.shape
    num_experts = weight.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids
    gemv = fuse and t <= FUSED_MAX_TOKENS
    if gemv:
        x, weight = x.contiguous(), weight.contiguous()
        logits = torch.empty(t, num_experts, dtype=torch.float32, device=x.device)
        block_t, block_e = min(triton.next_power_of_2(t), 16), min(_BLOCK_E, num_experts)
    else:
        logits = torch.nn.functional.linear(x.float(), weight.float()).contiguous()
        x = weight = logits  # unread without GEMV
        block_t, block_e = 1, num_experts
    block_h = max(16, min(triton.next_power_of_2(hidden), _TILE_ELEMS // (block_t * block_e)))
    grid = (num_experts // block_e, triton.cdiv(t, block_t))
    _route_kernel[grid](
        x,
        weight,
        bias,
        logits,
        _tickets_for(x.device, grid[1]) if gemv else ids,  # unread without GEMV
        weights,
        ids,
        t,
        hidden,
        x.stride(0),
        weight.stride(0),
        scaling,
        NUM_EXPERTS=num_experts,
        GROUPS=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_H=block_h,
        GEMV=gemv,
    )
    return weights, ids


def route_shapes_supported(num_experts: int, n_group: int, top_k: int) -> bool:
    """tl.arange needs powers of two: the experts per group, the groups and top_k."""
    per_group = num_experts // n_group

    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    return num_experts % n_group == 0 and pow2(per_group) and pow2(n_group) and pow2(top_k)
