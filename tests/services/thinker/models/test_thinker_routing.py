"""Router selection per token by modality, and the grouped top-k rule, against direct computations."""

from __future__ import annotations

import torch
from omnistage.services.thinker.models.layers.moe import SparseMoeBlock, grouped_topk


def _direct_route(router, x: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loop straight from ming.md §2.2 (sets, sorted ids; weights in id order)."""
    ids, weights = [], []
    per_group = cfg.num_experts // cfg.n_group
    for row in x.float():
        s = torch.sigmoid(router.weight.float() @ row)
        b = s + router.expert_bias.float()
        group_score = [
            sorted(b[g * per_group : (g + 1) * per_group].tolist())[-2:] for g in range(cfg.n_group)
        ]
        groups = sorted(range(cfg.n_group), key=lambda g: -sum(group_score[g]))[: cfg.topk_group]
        allowed = [e for e in range(cfg.num_experts) if e // per_group in groups]
        chosen = sorted(sorted(allowed, key=lambda e: -float(b[e]))[: cfg.num_experts_per_tok])
        w = s[chosen] / (s[chosen].sum() + 1e-20) * cfg.routed_scaling_factor
        ids.append(chosen)
        weights.append(w)
    return torch.tensor(ids), torch.stack(weights)


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@torch.no_grad()
def test_router_per_modality_matches_direct(tiny_model):
    cfg = tiny_model.config
    moe: SparseMoeBlock = tiny_model.model.layers[1].mlp
    torch.manual_seed(0)
    x = torch.randn(24, cfg.hidden_size)
    modality = torch.tensor([0, 1, 2] * 8, dtype=torch.int8)
    weights, ids = _sorted(*moe.route(x, modality))
    for code, name in enumerate(("gate", "image_gate", "audio_gate")):
        rows = modality == code
        want_ids, want_w = _direct_route(getattr(moe, name), x[rows], cfg)
        assert torch.equal(ids[rows], want_ids), name
        torch.testing.assert_close(weights[rows], want_w, rtol=1e-6, atol=1e-7)
    # The three routers really differ on these tokens, so picking the wrong one would be caught.
    text_ids = _sorted(*moe.gate(x))[1]
    assert not torch.equal(text_ids[modality == 1], ids[modality == 1])
    assert not torch.equal(text_ids[modality == 2], ids[modality == 2])


@torch.no_grad()
def test_expert_bias_changes_selection_but_not_weight_formula(tiny_model):
    moe = tiny_model.model.layers[2].mlp
    x = torch.randn(64, tiny_model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    scores = torch.sigmoid(x @ moe.gate.weight.float().t())
    cfg = tiny_model.config
    biased = grouped_topk(scores, moe.gate.expert_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group)
    unbiased = grouped_topk(
        scores, torch.zeros_like(moe.gate.expert_bias), cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    )
    assert not torch.equal(biased.sort(-1).values, unbiased.sort(-1).values)
    w, ids = moe.gate(x)
    assert torch.equal(ids.sort(-1).values, biased.sort(-1).values)
    torch.testing.assert_close(w.sum(-1), torch.full((64,), cfg.routed_scaling_factor), rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_model_forward_uses_modality(tiny_model):
    ids = torch.arange(30, 60)
    pos = torch.arange(30).expand(3, -1)
    text = tiny_model(ids, pos)
    vision = torch.zeros(30, dtype=torch.uint8)
    vision[10:20] = 1
    mixed = tiny_model(ids, pos, modality=vision)
    # Tokens before the first vision token are unaffected (causal); later ones change.
    torch.testing.assert_close(mixed[:10], text[:10], rtol=1e-5, atol=1e-5)
    assert (mixed[10:] - text[10:]).abs().max() > 1e-4
    torch.testing.assert_close(tiny_model(ids, pos, modality=torch.zeros(30, dtype=torch.int8)), text)
