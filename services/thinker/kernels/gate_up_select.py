"""A MoE layer of one token with its experts selected in the streaming gate-up launch (issue 40).

Today's three launches (`router.normed_route` → `moe_one_token.one_token_experts`): the router's 64
programs compute the add + RMSNorm and the fp32 gate logits, each takes a ticket and the last
selects the experts (~3.4 µs of its 6.6 µs a layer on one H200); the gate-up reads the ids after its
wait, the down reads them (two launches back: settled) and its chosen experts' rows before its wait.
Here the router's launch stops at the logits (`router.normed_logits`: no ticket, no selecting
program), every program of the streaming gate-up selects after its wait by the router's rule
(`route_select.choose_experts`, the same ops: the same bits), program 0 stores the ids and the
routing weights times the scaling, and the down launch reads those one launch back, after its wait
(`moe_one_token.selecting_experts`, `IDS_SETTLED=False`): only the shared expert's rows are read
before it -- unless the gate-up's program 0 raises the ids-ready flag after its stores and the down's
programs that see it before their wait read the ids and their rows then (`ready_flag.py`; on unless
OMNISTAGE_THINKER_DOWN_FLAG=off), so that the chosen experts' down rows stream while the gate-up runs
again. Whether the router's saving outweighs the down's later reads is the GPU bench's
(`bench/moe_one_token_gpu.py`); off unless OMNISTAGE_THINKER_GATEUP_SELECT=on (layers/backends.py).
"""

from __future__ import annotations

import torch
from omnistage.services.thinker.kernels import moe_one_token, router
from omnistage.services.thinker.kernels.moe_one_token import RouterLogits


def selects(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    n_group: int,
    top_k: int,
    experts: tuple[torch.Tensor, torch.Tensor],
    shared: tuple[torch.Tensor, torch.Tensor] | None,
) -> bool:
    """The one dispatch rule: one token whose router folds the norm (`router.folds_norm`: the gemv
    path), the router's selection shapes (`router.route_shapes_supported`), the one-token experts
    (`moe_one_token.supports`: a shared expert of an expert's shape, one dtype) and the gate-up
    streaming on this device (`moe_one_token.default_tiles`)."""
    (w13, w2), hidden = experts, x.shape[-1]
    if x.shape[0] != 1 or not moe_one_token.supports(x, w13, w2, top_k, shared):
        return False
    sms = moe_one_token.sm_count(x.device)
    tiles = moe_one_token.default_tiles(hidden, w13.shape[1] // 2, top_k, x.element_size(), sms=sms)
    return (
        tiles.programs > 0
        and router.route_shapes_supported(weight.shape[0], n_group, top_k)
        and router.folds_norm(x, weight, residual, norm_weight)
    )


def normed_select_experts(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor,
    route: tuple[int, int, int, float],
    experts: tuple[torch.Tensor, torch.Tensor],
    shared: tuple[torch.Tensor, torch.Tensor],
    flag: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the routed and shared experts' output for norm(x + residual), x + residual) in the three
    launches above, `route` = (top_k, n_group, topk_group, scaling), `experts` = (w13, w2), `shared`
    = the shared expert's (gate_up, down): `router.normed_route` then
    `moe_one_token.one_token_experts`, bit for bit. `flag` (OMNISTAGE_THINKER_DOWN_FLAG): the down
    reads the ids and its rows before its wait where the gate-up's ids-ready flag says they are
    stored (`ready_flag.py`). None where `selects` says no."""
    top_k, n_group, topk_group, scaling = route
    if not selects(x, residual, norm_weight, weight, n_group, top_k, experts, shared):
        return None
    logits, normed, total = router.normed_logits(
        x, residual, norm_weight, eps, weight, bias, n_group, topk_group, top_k
    )
    select = RouterLogits(logits, bias, n_group, topk_group, top_k, scaling)
    out, _, _ = moe_one_token.selecting_experts(normed, *experts, select, shared, flag=flag)
    return out, total
