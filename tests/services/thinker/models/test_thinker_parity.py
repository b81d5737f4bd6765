"""Parity of our BailingMoeV2 with transformers' Glm4MoeForCausalLM (same maths for text tokens).

Glm4Moe has the same sigmoid + bias grouped top-k router (top-2 group score, renormalise + 1e-20,
routed scaling), QK-norm before a partial NeoX rope on the first rotary_dim dims, a shared expert
and dense first layers. Text-only positions are equal on the 3 axes, so video_rope reduces to 1D.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # a dev dependency: the reference must be there, never skipped
from omnistage.common.checkpoint.shards import iter_tensors, shard_files
from omnistage.services.thinker.models.layers.attention import AttentionMetadata, attention_metadata

PROMPTS = [
    [5, 100, 300, 7, 8, 900],
    list(range(40, 90)),
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 200, 201, 202, 1000, 1100, 1150],
]


def _hf_model(ckpt, cfg):
    hf_cfg = transformers.Glm4MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.num_shared_experts,
        n_routed_experts=cfg.num_experts,
        routed_scaling_factor=cfg.routed_scaling_factor,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        first_k_dense_replace=cfg.first_k_dense_replace,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=False,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    )
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"
    model = transformers.Glm4MoeForCausalLM(hf_cfg).float().eval()
    raw = {k: v.float() for shard in shard_files(ckpt) for k, v in iter_tensors(shard)}
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sd = {
        "model.embed_tokens.weight": raw["model.model.word_embeddings.weight"],
        "model.norm.weight": raw["model.model.norm.weight"],
        "lm_head.weight": raw["model.lm_head.weight"],
    }
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.model.layers.{i}.", f"model.layers.{i}."
        q, k, v = raw[src + "attention.query_key_value.weight"].split([q_rows, kv_rows, kv_rows])
        sd.update(
            {
                dst + "self_attn.q_proj.weight": q,
                dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": raw[src + "attention.dense.weight"],
                dst + "self_attn.q_norm.weight": raw[src + "attention.q_norm.weight"],
                dst + "self_attn.k_norm.weight": raw[src + "attention.k_norm.weight"],
                dst + "input_layernorm.weight": raw[src + "input_layernorm.weight"],
                dst + "post_attention_layernorm.weight": raw[src + "post_attention_layernorm.weight"],
            }
        )
        if not cfg.is_moe_layer(i):
            for p in ("gate_proj", "up_proj", "down_proj"):
                sd[dst + f"mlp.{p}.weight"] = raw[src + f"mlp.{p}.weight"]
            continue
        sd[dst + "mlp.gate.weight"] = raw[src + "mlp.gate.weight"]
        sd[dst + "mlp.gate.e_score_correction_bias"] = raw[src + "mlp.gate.expert_bias"]
        experts = range(cfg.num_experts)
        sd[dst + "mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [
                        raw[src + f"mlp.experts.{e}.gate_proj.weight"],
                        raw[src + f"mlp.experts.{e}.up_proj.weight"],
                    ]
                )
                for e in experts
            ]
        )
        sd[dst + "mlp.experts.down_proj"] = torch.stack(
            [raw[src + f"mlp.experts.{e}.down_proj.weight"] for e in experts]
        )
        for p in ("gate_proj", "up_proj", "down_proj"):
            sd[dst + f"mlp.shared_experts.{p}.weight"] = raw[src + f"mlp.shared_experts.{p}.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt, tiny_model):
    return _hf_model(tiny_ckpt, tiny_model.config)


def _ours_logits(model, ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids)
    return model.compute_logits(model(t, torch.arange(len(ids)).expand(3, -1)))


@torch.no_grad()
def test_logits_match_glm4moe(tiny_model, hf_model):
    for ids in PROMPTS:
        ref = hf_model(torch.tensor([ids])).logits[0].float()
        ours = _ours_logits(tiny_model, ids)
        assert ours.shape == ref.shape == (len(ids), tiny_model.config.vocab_size)
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel <= 1e-5, f"max relative error {rel:.2e} for prompt {ids[:8]}..."


@torch.no_grad()
def test_batched_sequences_match_separate_forwards(tiny_model):
    ids = torch.tensor(PROMPTS[0] + PROMPTS[2])
    pos = torch.cat([torch.arange(len(PROMPTS[0])), torch.arange(len(PROMPTS[2]))]).expand(3, -1)
    with attention_metadata(AttentionMetadata.no_cache([len(PROMPTS[0]), len(PROMPTS[2])])):
        joint = tiny_model.compute_logits(tiny_model(ids, pos))
    separate = torch.cat([_ours_logits(tiny_model, PROMPTS[0]), _ours_logits(tiny_model, PROMPTS[2])])
    torch.testing.assert_close(joint, separate, rtol=1e-5, atol=1e-5)


def _greedy_hf(hf_model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _greedy_ours_paged(model, prompt: list[int], steps: int, block_size: int = 4) -> list[int]:
    num_blocks = (len(prompt) + steps) // block_size + 1
    for layer in model.attention_layers():
        layer.k_cache = torch.zeros(model.kv_cache_shape(num_blocks, block_size))
        layer.v_cache = torch.zeros(model.kv_cache_shape(num_blocks, block_size))
    # Blocks in reverse order so the block table really matters.
    table = torch.arange(num_blocks - 1, -1, -1)[None]
    slot = lambda p: int(table[0, p // block_size]) * block_size + p % block_size  # noqa: E731
    out: list[int] = []
    step_ids, start = list(prompt), 0
    try:
        for _ in range(steps):
            n = len(step_ids)
            md = AttentionMetadata(
                query_lens=[n],
                context_lens=[start + n],
                slot_mapping=torch.tensor([slot(p) for p in range(start, start + n)]),
                block_tables=table,
            )
            with attention_metadata(md):
                hidden = model(torch.tensor(step_ids), torch.arange(start, start + n).expand(3, -1))
            out.append(int(model.compute_logits(hidden[-1:]).argmax()))
            start += n
            step_ids = [out[-1]]
    finally:
        for layer in model.attention_layers():
            layer.k_cache = layer.v_cache = torch.empty(0)
    return out


@torch.no_grad()
def test_greedy_decode_matches_glm4moe(tiny_model, hf_model):
    prompt, steps = PROMPTS[0], 64
    ref = _greedy_hf(hf_model, prompt, steps)
    assert len(set(ref)) > 8, "degenerate reference continuation: the test would prove little"
    full = []
    ids = list(prompt)
    for _ in range(steps):
        full.append(int(_ours_logits(tiny_model, ids)[-1].argmax()))
        ids.append(full[-1])
    assert full == ref
    assert _greedy_ours_paged(tiny_model, prompt, steps) == ref
