"""The thinker LLM, BailingMoeV2 (ming.md §2), over flattened tokens with TP-aware layers.

Module names follow the HF checkpoint (`model.layers.{i}.attention.query_key_value`, `mlp.gate`,
`mlp.image_gate`, ...); the only renames are the fused params listed in `param_for_checkpoint_key`.
Attention reads the step's AttentionMetadata (no metadata → one causal sequence without cache).
"""

from __future__ import annotations

import re

import torch
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.layers.attention import PagedAttention, QKNormRope
from omnistage.services.thinker.models.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from omnistage.services.thinker.models.layers.linear import QKVParallelLinear, RowParallelLinear
from omnistage.services.thinker.models.layers.moe import ROUTER_NAMES, GatedMLP, RouterRows, SparseMoeBlock
from omnistage.services.thinker.models.layers.norm import RMSNorm
from omnistage.services.thinker.models.layers.parallel import TPGroup
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding
from torch import nn


class BailingMoeV2Attention(nn.Module):
    def __init__(self, config: ThinkerConfig, tp: TPGroup) -> None:
        super().__init__()
        d = config.head_dim
        self.query_key_value = QKVParallelLinear(
            config.hidden_size, d, config.num_attention_heads, config.num_key_value_heads, tp
        )
        self.num_heads, self.num_kv_heads, self.head_dim = (
            self.query_key_value.num_heads,
            self.query_key_value.num_kv_heads,
            d,
        )
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.use_qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.use_qk_norm else None
        self.rotary_emb = RotaryEmbedding(d, config.rotary_dim, config.rope_theta, config.rope_type)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5)
        self.dense = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, tp)
        self.eps = config.rms_norm_eps

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input as x + residual (residual None: x alone), its input `norm`, and the
        step's rope cos/sin [T, rotary_dim] → ([T, H] this rank's partial sum, x + residual). The
        add + norm runs with the qkv projection (one launch where the kernel serves the step).
        q and k go to the attention raw, with their QK-norm weights and the rope (`QKNormRope`): the
        attention's backend applies them (the reference q_norm, k_norm, rope, or a kernel) -- or,
        where the backend would run them in a launch of their own, the qkv projection's launch
        does, and q and k go normed and roped (`QKVParallelLinear.normed_roped`)."""
        t, d = x.shape[0], self.head_dim
        q_w = self.q_norm.weight if self.q_norm is not None else None
        k_w = self.k_norm.weight if self.k_norm is not None else None
        qk_rope = QKNormRope(q_w, k_w, self.eps, *rope)
        apart = self.attn.qk_rope_apart(t)
        qkv, residual, roped = self.query_key_value.normed_roped(x, norm, residual, qk_rope, apart)
        q_width, kv_width = self.num_heads * d, self.num_kv_heads * d
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
        out = self.attn(q, k, v, None if roped else qk_rope)
        return self.dense(out.reshape(t, -1)), residual


class BailingMoeV2DecoderLayer(nn.Module):
    def __init__(self, config: ThinkerConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = BailingMoeV2Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if config.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(
                config.hidden_size,
                config.num_experts,
                config.moe_intermediate_size,
                config.num_shared_experts,
                config.num_experts_per_tok,
                config.n_group,
                config.topk_group,
                config.routed_scaling_factor,
                config.multi_router,
                tp,
            )
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        modality: RouterRows | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream as a pair: the layer's input is x + residual (residual None: x alone,
        the first layer); returns (this layer's MLP output, the stream before it). Same sums as
        `h = x + attn(norm(x)); return h + mlp(norm(h))`, with each add fused into the next norm
        (the MLP may take the post-attention add + norm into its first launch: a MoE block's router,
        `SparseMoeBlock.normed`; a dense MLP's gate-up, `GatedMLP.normed`)."""
        x, residual = self.attention(x, residual, self.input_layernorm, rope)
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp.normed(x, residual, self.post_attention_layernorm, modality)
        return self.mlp.normed(x, residual, self.post_attention_layernorm)


class BailingMoeV2Model(nn.Module):
    def __init__(self, config: ThinkerConfig, tp: TPGroup) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            BailingMoeV2DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.num_routers = len(ROUTER_NAMES) if config.multi_router else 1

    @property
    def rotary(self) -> RotaryEmbedding:
        """The rope every layer applies (the first layer's: the forward makes its cos/sin once)."""
        return self.layers[0].attention.rotary_emb

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, modality: torch.Tensor | RouterRows | None
    ) -> torch.Tensor:
        # Which tokens each router takes is found once here, not again in every MoE layer (a caller
        # that must not sync the host passes RouterRows.every_router instead of the codes).
        routers = modality if isinstance(modality, RouterRows) else None
        if isinstance(modality, torch.Tensor) and self.num_routers > 1:
            routers = RouterRows.of(modality, self.num_routers)
        # One cos/sin for the step, shared by every layer (all layers rotate alike).
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, routers)
        return self.norm(hidden, residual)[0]


class BailingMoeV2ForCausalLM(nn.Module):
    """Thinker over one step's flattened tokens; logits only for the rows the engine asks for."""

    def __init__(self, config: ThinkerConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        if config.use_qkv_bias or config.use_bias:
            raise ValueError("BailingMoeV2 with qkv/output biases is not supported (Ming has none)")
        if config.tie_word_embeddings:
            raise ValueError("tied embeddings are not supported (Ming unties them)")
        self.config = config
        self.tp = tp or TPGroup()
        self.model = BailingMoeV2Model(config, self.tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.tp)

    def embed_tokens(
        self,
        input_ids: torch.Tensor,
        media_index: torch.Tensor | None = None,
        media_rows: torch.Tensor | None = None,
        sampled: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings [T, H] (no scaling) with the encoder rows spliced into the placeholder
        slots: row k of `media_rows` replaces token row `media_index[k]` (ming.md §2.2 step 1).
        With `sampled` [S] an input id -r - 1 stands for `sampled[r]` (the step before's ids)."""
        return self.model.word_embeddings(input_ids, media_index, media_rows, sampled)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        modality: torch.Tensor | RouterRows | None = None,
        inputs_embeds: torch.Tensor | None = None,
        media_index: torch.Tensor | None = None,
        media_rows: torch.Tensor | None = None,
        sampled: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids [T], positions [3, T] (or [T]) → final-norm hidden [T, H].

        modality [T]: router codes 0 text / 1 vision / 2 audio (None: text; or RouterRows made from
        them); media_index [M] and media_rows [M, H]: encoder rows to splice (under TP only rank 0
        passes the rows); sampled [S]: the ids the placeholders among `input_ids` name (row r's
        placeholder is -r - 1)."""
        if inputs_embeds is None:
            hidden = self.embed_tokens(input_ids, media_index, media_rows, sampled)
        else:
            hidden = inputs_embeds
        if positions.dim() == 1:
            positions = positions[None].expand(3, -1)
        return self.model(hidden, positions, modality)

    def bound_positions(self, max_len: int | None) -> None:
        """Every position passed from now on is one of a sequence of at most `max_len` tokens (the
        engine's max_model_len): the rope gathers its cos/sin from a table (rotary.py)."""
        self.model.rotary.bound_positions(max_len)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[R, H] → logits [R, vocab_size] in the model's dtype (bf16 serving, fp32 the CPU reference),
        gathered across TP ranks; the sampler casts to fp32 where a row needs values."""
        return self.lm_head(hidden_rows)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.attention.attn for layer in self.model.layers]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) cache on this rank."""
        a = self.model.layers[0].attention
        return (num_blocks, block_size, a.num_kv_heads, a.head_dim)


# --- checkpoint naming (ming.md §2.4) -------------------------------------------------------------

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_GATE_UP = re.compile(r"^(.*\.mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight$")


def param_for_checkpoint_key(key: str) -> tuple[str, object] | None:
    """Checkpoint key → (our parameter name, shard id for its weight_loader); None: not a thinker key."""
    if key == "model.lm_head.weight":
        return "lm_head.weight", None
    if not key.startswith("model.model."):
        return None
    name = key[len("model.") :]
    if m := _EXPERT.match(name):
        return f"{m[1]}.{'w2' if m[3] == 'down' else 'w13'}", (int(m[2]), m[3])
    if m := _GATE_UP.match(name):
        return f"{m[1]}.gate_up_proj.weight", 0 if m[2] == "gate" else 1
    return name, None


def checkpoint_shapes(config: ThinkerConfig) -> dict[str, tuple[int, ...]]:
    """Every thinker tensor the checkpoint must hold, with its full (unsharded) shape."""
    c, h, d = config, config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.model.word_embeddings.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"model.model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "attention.query_key_value.weight"] = (
            (c.num_attention_heads + 2 * c.num_key_value_heads) * d,
            h,
        )
        if c.use_qk_norm:
            shapes[p + "attention.q_norm.weight"] = (d,)
            shapes[p + "attention.k_norm.weight"] = (d,)
        shapes[p + "attention.dense.weight"] = (h, c.num_attention_heads * d)
        if not c.is_moe_layer(i):
            _mlp_shapes(shapes, p + "mlp.", h, c.intermediate_size)
            continue
        for gate in ROUTER_NAMES if c.multi_router else ROUTER_NAMES[:1]:
            shapes[p + f"mlp.{gate}.weight"] = (c.num_experts, h)
            shapes[p + f"mlp.{gate}.expert_bias"] = (c.num_experts,)
        for e in range(c.num_experts):
            _mlp_shapes(shapes, p + f"mlp.experts.{e}.", h, c.moe_intermediate_size)
        if c.num_shared_experts:
            _mlp_shapes(shapes, p + "mlp.shared_experts.", h, c.moe_intermediate_size * c.num_shared_experts)
    shapes["model.model.norm.weight"] = (h,)
    shapes["model.lm_head.weight"] = (c.vocab_size, h)
    return shapes


def _mlp_shapes(shapes: dict[str, tuple[int, ...]], prefix: str, hidden: int, inter: int) -> None:
    shapes[prefix + "gate_proj.weight"] = (inter, hidden)
    shapes[prefix + "up_proj.weight"] = (inter, hidden)
    shapes[prefix + "down_proj.weight"] = (hidden, inter)
