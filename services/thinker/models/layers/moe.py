"""BailingMoeV2 feed-forward: SwiGLU MLPs, sigmoid group-limited routers, and the sparse MoE block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omnistage.services.thinker.models.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    check_shape,
)
from omnistage.services.thinker.models.layers.norm import RMSNorm
from omnistage.services.thinker.models.layers.parallel import TPGroup, divide
from torch import nn

# modality codes the engine passes per token; index into the router list.
TEXT, VISION, AUDIO = 0, 1, 2
ROUTER_NAMES = ("gate", "image_gate", "audio_gate")


@dataclass(frozen=True)
class RouterRows:
    """The token rows each router takes in one step (found once per forward, used by every MoE layer).

    `rows[code]` is the index tensor of the tokens with that modality code, None when there are none;
    `single` is the one code every token has (then no gather or scatter is needed), else None.
    `codes` (`every_router`): no host sync — every router runs on every token and each token keeps its
    own code's choice (a CUDA graph's step, whose codes are only known on the device)."""

    rows: tuple[torch.Tensor | None, ...]
    single: int | None
    codes: torch.Tensor | None = None

    @classmethod
    def every_router(cls, modality: torch.Tensor, num_routers: int = len(ROUTER_NAMES)) -> RouterRows:
        """The codes as they are on the device, read by no host code (codes past the routers: text)."""
        return cls((None,) * num_routers, None, modality.to(torch.long))

    @classmethod
    def of(cls, modality: torch.Tensor, num_routers: int = len(ROUTER_NAMES)) -> RouterRows:
        """From [T] codes 0 (text), 1 (vision), 2 (audio); codes without their router are refused."""
        codes = modality.to(torch.long)
        try:
            counts = torch.bincount(codes, minlength=num_routers).tolist()  # the step's one host sync
        except RuntimeError as exc:  # a negative code
            raise ValueError(f"modality codes must be 0 (text), 1 (vision) or 2 (audio): {exc}") from None
        if len(counts) > num_routers:
            raise ValueError(
                f"modality codes must be 0 (text), 1 (vision) or 2 (audio) with {num_routers} routers"
            )
        present = [code for code, n in enumerate(counts) if n]
        if len(present) <= 1:
            return cls((None,) * num_routers, present[0] if present else 0)
        order = codes.argsort(stable=True)
        rows, start = [], 0
        for n in counts:
            rows.append(order[start : start + n] if n else None)
            start += n
        return cls(tuple(rows), None)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up fused column-parallel and down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup, reduce: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, reduce=reduce)
        # silu_and_mul(gate_up) in one launch (layers/backends.py); None: the reference.
        self.act: Callable[[torch.Tensor], torch.Tensor] | None = None
        # (x, gate_up weight) → silu(gate(x)) * up(x), the projection and the activation in one
        # launch, or None where it does not serve (a decode step's one or two tokens:
        # kernels/dense_gate_up.py; set by layers/backends.py); None: the projection, then `act`.
        self.gate_up_act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None
        # (x, gate_up weight, norm weight, eps, residual or None) → (silu(gate(h)) * up(h), x +
        # residual) for h = norm(x + residual) in one launch, or None where it does not serve: the
        # decoder layer's add + norm before a dense MLP folded into its gate-up launch
        # (kernels/dense_gate_up.py `normed_gate_up_act`; set by layers/backends.py); None: the
        # norm, then `forward`.
        self.norm_gate_up_act: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_act is not None:
            h = self.gate_up_act(x, self.gate_up_proj.weight)
            if h is not None:
                return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        if self.act is not None:
            return self.down_proj(self.act(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def normed(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this MLP's output for norm(x + residual), x + residual) -- residual None: for norm(x),
        and x --: the decoder layer's add + norm before it, in the gate-up's launch where
        `norm_gate_up_act` serves (one token, the fast backends' fusions); else the norm runs, then
        `forward`. The same sums."""
        if self.norm_gate_up_act is not None:
            folded = self.norm_gate_up_act(x, self.gate_up_proj.weight, norm.weight, norm.eps, residual)
            if folded is not None:
                h, residual = folded
                return self.down_proj(h), residual
        if residual is None:
            return self(norm(x)), x
        h, residual = norm(x, residual)
        return self(h), residual


def grouped_topk(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int
) -> torch.Tensor:
    """Expert ids [T, top_k]: biased scores, keep the `topk_group` groups with the best top-2 sums."""
    biased = scores + bias.float()
    t, e = biased.shape
    grouped = biased.view(t, n_group, e // n_group)
    group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    masked = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)
    return masked.topk(top_k, dim=-1).indices


class Router(nn.Module):
    """Sigmoid router with a selection-only expert bias (ming.md §2.2 MoE steps 1-3), math in fp32."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int, scaling: float
    ) -> None:
        super().__init__()
        divide(num_experts, n_group, "experts per group (num_experts / n_group)")
        self.top_k, self.n_group, self.topk_group, self.scaling = top_k, n_group, topk_group, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.expert_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        # route(x, weight, bias, top_k, n_group, topk_group, scaling): the GEMV and the selection
        # below (layers/backends.py); None: the reference.
        self.kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        # normed_route(x, residual, norm weight, eps, weight, bias, top_k, n_group, topk_group,
        # scaling) → (weights, ids, norm(x + residual), x + residual), or None where it does not
        # serve: the add + RMSNorm before the router in its launch (kernels/router.py; set by
        # layers/backends.py); None: the norm runs first.
        self.norm_kernel: Callable[..., tuple[torch.Tensor, ...] | None] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (fp32 weights [T, k], expert ids [T, k])."""
        if self.kernel is not None:
            return self.kernel(
                x, self.weight, self.expert_bias, self.top_k, self.n_group, self.topk_group, self.scaling
            )
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        ids = grouped_topk(scores, self.expert_bias, self.top_k, self.n_group, self.topk_group)
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        return w, ids

    def normed(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(weights, ids, norm(x + residual), x + residual) in one launch where `norm_kernel`
        serves (a few tokens); None elsewhere: the caller norms, then routes."""
        if self.norm_kernel is None:
            return None
        return self.norm_kernel(
            x,
            residual,
            norm.weight,
            norm.eps,
            self.weight,
            self.expert_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.scaling,
        )


class FusedExperts(nn.Module):
    """All experts stacked: w13 [E, 2*I_local, H] (gate rows then up rows), w2 [E, H, I_local]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local = divide(intermediate, tp.size, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.local), requires_grad=False)
        # A fused kernel with this forward's signature (layers/backends.py); None: the reference loop.
        self.kernel: Callable[..., torch.Tensor] | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """shard_id = (expert, "gate" | "up" | "down"): one checkpoint tensor per expert."""
        expert, kind = shard_id  # type: ignore[misc]
        n, r = self.local, self.tp.rank
        if kind == "down":
            check_shape(f"experts.{expert}.down_proj", loaded.shape, (param.shape[1], n * self.tp.size))
            param.data[expert].copy_(loaded.narrow(1, r * n, n))
            return
        check_shape(f"experts.{expert}.{kind}_proj", loaded.shape, (n * self.tp.size, param.shape[2]))
        offset = 0 if kind == "gate" else n
        param.data[expert, offset : offset + n].copy_(loaded.narrow(0, r * n, n))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: GatedMLP | None = None
    ) -> torch.Tensor:
        """Weighted expert mix accumulated in fp32, rounded once to x's dtype, plus the shared
        expert's output when given: [T, H] (this rank's partial sum under TP). The kernel takes the
        shared expert's weights, so it may run it with the routed experts."""
        if self.kernel is not None:
            pair = None if shared is None else (shared.gate_up_proj.weight, shared.down_proj.weight)
            return self.kernel(x, self.w13, self.w2, weights, ids, pair)
        t, k = ids.shape
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        tokens = order // k
        flat_w = weights.flatten()[order]
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            idx = tokens[start : start + n]
            gate, up = F.linear(x[idx], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert])
            out.index_add_(0, idx, y.float() * flat_w[start : start + n, None])
            start += n
        out = out.to(x.dtype)
        return out if shared is None else out + shared(x)


class SparseMoeBlock(nn.Module):
    """Routed experts (router picked per token by modality) + shared expert, one all-reduce."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        intermediate: int,
        num_shared: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        scaling: float,
        multi_router: bool,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        self.tp = tp
        names = ROUTER_NAMES if multi_router else ROUTER_NAMES[:1]
        for name in names:
            setattr(self, name, Router(hidden, num_experts, top_k, n_group, topk_group, scaling))
        self.router_names = names
        self.experts = FusedExperts(num_experts, hidden, intermediate, tp)
        self.shared_experts = (
            GatedMLP(hidden, intermediate * num_shared, tp, reduce=False) if num_shared > 0 else None
        )
        # normed_select_experts(x, residual, norm weight, eps, gate weight, expert bias, (top_k,
        # n_group, topk_group, scaling), (w13, w2), shared (gate_up, down)) → (experts' output, x +
        # residual), or None where its rule says no: a token's layer with the experts selected in the
        # gate-up launch (kernels/gate_up_select.py; set by layers/backends.py); None: the router selects.
        self.select_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def _groups(self, modality: torch.Tensor | RouterRows | None) -> RouterRows | None:
        """The step's RouterRows (found from the codes once, here); None: the gate takes every token."""
        if modality is None or len(self.router_names) == 1:
            return None
        if isinstance(modality, RouterRows):
            return modality
        return RouterRows.of(modality, len(self.router_names))

    def _step_router(self, groups: RouterRows | None) -> Router | None:
        """The one router every token of the step takes; None when several serve it."""
        if groups is None:
            return self.gate
        return None if groups.single is None else getattr(self, self.router_names[groups.single])

    def route(
        self, x: torch.Tensor, modality: torch.Tensor | RouterRows | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (weights, ids) from gate / image_gate / audio_gate by modality 0 / 1 / 2.

        Each router runs once, on its own tokens only (no per-token loop); `modality` is the [T]
        codes or, from the model, the RouterRows it found once for all layers of the step."""
        groups = self._groups(modality)
        router = self._step_router(groups)
        if router is not None:
            return router(x)
        if groups.codes is not None:  # every router on every token, each token its own code's choice
            weights, ids = self.gate(x)
            for code, name in enumerate(self.router_names[1:], start=1):
                mine = (groups.codes == code)[:, None]
                w, i = getattr(self, name)(x)
                weights, ids = torch.where(mine, w, weights), torch.where(mine, i, ids)
            return weights, ids
        k = self.gate.top_k
        weights = torch.empty(x.shape[0], k, dtype=torch.float32, device=x.device)
        ids = torch.empty(x.shape[0], k, dtype=torch.long, device=x.device)
        for name, rows in zip(self.router_names, groups.rows, strict=True):
            if rows is not None:
                weights[rows], ids[rows] = getattr(self, name)(x[rows])
        return weights, ids

    def forward(self, x: torch.Tensor, modality: torch.Tensor | RouterRows | None = None) -> torch.Tensor:
        weights, ids = self.route(x, modality)
        return self.tp.all_reduce(self.experts(x, weights, ids, self.shared_experts))

    def normed(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm: RMSNorm,
        modality: torch.Tensor | RouterRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's output for norm(x + residual), x + residual): the decoder layer's add +
        norm before it. Where one router takes every token of the step and its kernel folds the
        norm (`Router.normed`: a few tokens, the fusions on), the router's launch computes the
        normed row and the experts read it -- at one token, where `select_kernel` serves, the
        router's logits only, the experts selected in the gate-up launch --; else the norm runs,
        then `forward`. The same sums."""
        groups = self._groups(modality)
        router = self._step_router(groups)
        selected = None if router is None else self._selected(x, residual, norm, router)
        if selected is not None:
            return selected
        folded = None if router is None else router.normed(x, residual, norm)
        if folded is None:
            h, residual = norm(x, residual)
            return self(h, groups), residual
        weights, ids, h, residual = folded
        return self.tp.all_reduce(self.experts(h, weights, ids, self.shared_experts)), residual

    def _selected(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, router: Router
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`normed` through `select_kernel` (its rule: one token, the router's fold, the streaming
        gate-up), where the router's fold is installed; None where it does not serve."""
        shared = self.shared_experts
        if self.select_kernel is None or router.norm_kernel is None or shared is None:
            return None
        route = (router.top_k, router.n_group, router.topk_group, router.scaling)
        got = self.select_kernel(
            x,
            residual,
            norm.weight,
            norm.eps,
            router.weight,
            router.expert_bias,
            route,
            (self.experts.w13, self.experts.w2),
            (shared.gate_up_proj.weight, shared.down_proj.weight),
        )
        if got is None:
            return None
        out, residual = got
        return self.tp.all_reduce(out), residual
