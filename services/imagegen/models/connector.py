"""Thinker hidden states → DiT caption features (ming.md §6.1 steps 4 and 6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omnistage.common.hf_blocks import Qwen2MLP, Qwen2RMSNorm, rotate_half
from omnistage.services.imagegen.models.config import ConnectorConfig, MlpConfig
from torch import nn


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: ConnectorConfig) -> None:
        super().__init__()
        d = cfg.head_size
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * d, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=True)
        self.o_proj = nn.Linear(self.heads * d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, -1).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v)  # bidirectional: no mask, not causal
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class Qwen2Layer(nn.Module):
    def __init__(self, cfg: ConnectorConfig) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = Qwen2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Body(nn.Module):
    """`model.layers` + `model.norm` of a Qwen2ForCausalLM (embeddings and LM head are not used)."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Qwen2Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen2Encoder(nn.Module):
    """The connector: inputs_embeds [B, N, hidden] → final-norm hidden states, every token sees every token."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen2Body(cfg)

    def rope(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..n-1, default RoPE (float32 angles, cos/sin cast to the activation dtype)."""
        d = self.cfg.head_size
        inv_freq = 1.0 / (
            self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
        )
        freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(embeds.shape[1], embeds.device, embeds.dtype)
        x = embeds
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)


class ToClipMLP(nn.Module):
    """The DiT wrapper's MLP when `use_identity_mlp` is false: Linear → LN → ReLU → Linear → LN."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cin, 2048)
        self.layer_norm1 = nn.LayerNorm(2048)
        self.fc2 = nn.Linear(2048, cout)
        self.layer_norm2 = nn.LayerNorm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_norm2(self.fc2(F.relu(self.layer_norm1(self.fc1(x)))))


class ConditionEncoder(nn.Module):
    """`condition(hidden)` → normalised conditioning; `caption(condition)` → the DiT's caption features."""

    def __init__(
        self, mlp_cfg: MlpConfig, conn_cfg: ConnectorConfig, thinker_hidden: int, cap_feat_dim: int
    ) -> None:
        super().__init__()
        self.text_encoder_norm = mlp_cfg.text_encoder_norm
        self.proj_in = nn.Linear(thinker_hidden, conn_cfg.hidden_size)
        self.connector = Qwen2Encoder(conn_cfg)
        self.proj_out = nn.Linear(conn_cfg.hidden_size, mlp_cfg.diffusion_c_input_dim)
        self.mlp = (
            nn.Identity()
            if mlp_cfg.use_identity_mlp
            else ToClipMLP(mlp_cfg.diffusion_c_input_dim, cap_feat_dim)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_in.weight.dtype

    def condition(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, Q, thinker_hidden] → [B, Q, diffusion_c_input_dim], unit L2 norm per token."""
        e = self.proj_out(self.connector(self.proj_in(hidden.to(self.dtype))))
        return F.normalize(e, dim=-1)

    def caption(self, condition: torch.Tensor) -> torch.Tensor:
        """What the DiT wrapper feeds the DiT: L2 normalise × 1000 (text_encoder_norm), then the MLP."""
        if self.text_encoder_norm:
            condition = F.normalize(condition, dim=-1) * 1000.0
        return self.mlp(condition)
