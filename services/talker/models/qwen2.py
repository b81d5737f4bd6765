"""A Qwen2 decoder stack (transformers' `Qwen2Model` maths) with a per-request slot KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omnistage.common.hf_blocks import Qwen2MLP, Qwen2RMSNorm, rotate_half
from omnistage.services.talker.models.config import Qwen2Shape
from torch import nn


@dataclass(frozen=True)
class Rows:
    """Where each row of a batch lives in the cache: slot, position of its first token, real tokens."""

    slots: torch.Tensor  # [B] long
    starts: torch.Tensor  # [B] long
    lengths: torch.Tensor  # [B] long, >= 1
    span: int  # max(starts + lengths): cache positions read (known on the host: no device sync)

    @classmethod
    def of(cls, slots: list[int], starts: list[int], lengths: list[int], device: str | torch.device) -> Rows:
        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.long).to(device, non_blocking=True)

        return cls(t(slots), t(starts), t(lengths), max(s + n for s, n in zip(starts, lengths, strict=True)))


class KVSlots:
    """Preallocated K/V of `num_slots` requests of at most `max_len` positions each, per layer.

    One extra slot at index `num_slots` takes the writes of padded tokens.
    """

    def __init__(
        self,
        shape: Qwen2Shape,
        num_slots: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        size = (num_slots + 1, shape.num_kv_heads, max_len, shape.head_dim)
        self.k = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class Qwen2Attention(nn.Module):
    def __init__(self, shape: Qwen2Shape, window: int) -> None:
        super().__init__()
        h, hd = shape.hidden_size, shape.head_dim
        self.q_proj = nn.Linear(h, shape.num_heads * hd, bias=True)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(shape.num_heads * hd, h, bias=False)
        self.heads, self.kv_heads, self.head_dim, self.window = (
            shape.num_heads,
            shape.num_kv_heads,
            hd,
            window,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        rows: Rows | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is None:
            keys, values, key_pos, valid_end = k, v, positions[0], positions[:, -1] + 1
        else:
            assert rows is not None
            keys, values = _write_and_read(cache, rows, positions, k, v)
            key_pos = torch.arange(keys.shape[2], device=x.device)
            valid_end = rows.starts + rows.lengths
        allowed = (key_pos[None, None, :] <= positions[:, :, None]) & (
            key_pos[None, None, :] < valid_end[:, None, None]
        )
        if self.window:
            allowed &= key_pos[None, None, :] > positions[:, :, None] - self.window
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None], enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _write_and_read(
    cache: tuple[torch.Tensor, torch.Tensor],
    rows: Rows,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this forward's K/V at their positions (padded tokens into the scratch slot), then read the
    rows' caches up to the longest row."""
    kc, vc = cache
    scratch = kc.shape[0] - 1
    real = torch.arange(positions.shape[1], device=positions.device)[None, :] < rows.lengths[:, None]
    slot = torch.where(real, rows.slots[:, None], scratch)
    pos = torch.where(real, positions, 0)
    kc[slot, :, pos] = k.transpose(1, 2)
    vc[slot, :, pos] = v.transpose(1, 2)
    return kc[rows.slots, :, : rows.span], vc[rows.slots, :, : rows.span]


class Qwen2Layer(nn.Module):
    def __init__(self, shape: Qwen2Shape, layer: int) -> None:
        super().__init__()
        self.input_layernorm = Qwen2RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Qwen2Attention(shape, shape.window(layer))
        self.post_attention_layernorm = Qwen2RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = Qwen2MLP(shape.hidden_size, shape.intermediate_size)

    def forward(self, x, cos, sin, positions, cache, rows):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Stack(nn.Module):
    """`Qwen2Model` over input embeddings; `embed_tokens` only where the model reads token ids."""

    def __init__(self, shape: Qwen2Shape, *, with_embeddings: bool) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size) if with_embeddings else None
        self.layers = nn.ModuleList(Qwen2Layer(shape, i) for i in range(shape.num_layers))
        self.norm = Qwen2RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.register_buffer("inv_freq", self.rope_inv_freq(shape), persistent=False)

    @staticmethod
    def rope_inv_freq(shape: Qwen2Shape) -> torch.Tensor:
        # On the CPU even in a meta build (common/checkpoint/loading.py `empty_on` says why).
        steps = torch.arange(0, shape.head_dim, 2, dtype=torch.int64, device="cpu").float()
        return 1.0 / (shape.rope_theta ** (steps / shape.head_dim))

    def init_buffers(self) -> None:
        """Recompute the rotary table after `to_empty` (it is not stored in checkpoints)."""
        self.inv_freq = self.rope_inv_freq(self.shape).to(self.inv_freq.device)

    def forward(
        self, x: torch.Tensor, cache: KVSlots | None = None, rows: Rows | None = None
    ) -> torch.Tensor:
        """x [B, T, hidden] → final-norm hidden states [B, T, hidden].

        Without a cache: every row is a whole causal sequence from position 0. With one: row b's tokens
        sit at positions rows.starts[b] + 0..T-1 of slot rows.slots[b]; only its first rows.lengths[b]
        are real (the rest is padding, its outputs are meaningless).
        """
        b, t, _ = x.shape
        offsets = torch.arange(t, device=x.device)
        positions = offsets[None, :].expand(b, t) if rows is None else rows.starts[:, None] + offsets[None, :]
        freqs = positions.float()[..., None] * self.inv_freq.float()[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(self.layers):
            kv = (cache.k[i], cache.v[i]) if cache is not None else None
            x = layer(x, cos, sin, positions, kv, rows)
        return self.norm(x)
