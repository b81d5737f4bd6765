"""The talker's flow-matching DiT (`cfm.model`), its CFM sampler, and the aggregator (ming.md §5.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omnistage.services.talker.models.config import DiTShape
from torch import nn

# Fixed time grids (in 1/32) per step count; other counts use an even grid (the reference's EPSS table).
_EPSS_32NDS: dict[int, tuple[int, ...]] = {
    5: (0, 2, 4, 8, 16, 32),
    6: (0, 2, 4, 6, 8, 16, 32),
    7: (0, 2, 4, 6, 8, 16, 24, 32),
    10: (0, 2, 4, 6, 8, 12, 16, 20, 24, 28, 32),
    12: (0, 2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32),
    16: (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32),
}


def sway_times(steps: int, sway_coef: float = -1.0) -> torch.Tensor:
    """The `steps + 1` integration times in float32: EPSS grid τ, then τ + coef·(cos(πτ/2) − 1 + τ)."""
    if steps in _EPSS_32NDS:
        t = torch.tensor(_EPSS_32NDS[steps], dtype=torch.float32) / 32
    else:
        t = torch.linspace(0, 1, steps + 1, dtype=torch.float32)
    return t + sway_coef * (torch.cos(math.pi / 2 * t) - 1 + t)


@dataclass(frozen=True)
class SamplePlan:
    """A CFM sample's fixed parts: time embeddings [steps, 1, 1, D], step sizes, rotary tables."""

    t_emb: torch.Tensor
    dts: tuple[float, ...]
    cos: torch.Tensor
    sin: torch.Tensor


class DiTRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.to(self.weight.dtype), (x.shape[-1],), self.weight, self.eps)


class InterleavedRotary(nn.Module):
    """x_transformers `RotaryEmbedding(head_dim)`; `inv_freq` is stored in the checkpoint (kept float32)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        # On the CPU even in a meta build (common/checkpoint/loading.py `empty_on` says why).
        self.register_buffer("inv_freq", self.default_inv_freq(head_dim, "cpu"))

    @staticmethod
    def default_inv_freq(head_dim: int, device: str | torch.device | None = None) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))

    def init_buffers(self) -> None:
        """float32 table after `to_empty` (the checkpoint's copy is loaded over it)."""
        self.inv_freq = self.default_inv_freq(self.head_dim, self.inv_freq.device)

    def cos_sin(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[seq_len, head_dim] float32 tables; each frequency repeated for its pair."""
        inv = self.inv_freq.float()
        freqs = torch.arange(seq_len, device=inv.device, dtype=torch.float32)[:, None] * inv[None, :]
        freqs = freqs.repeat_interleave(2, dim=-1)
        return freqs.cos(), freqs.sin()


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1) → (−x1, x0) for each pair (2i, 2i+1)."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * cos + _rotate_pairs(xf) * sin).to(x.dtype)


class DiTAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.heads = heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for proj in (self.to_q, self.to_k, self.to_v)
        )
        q, k = apply_interleaved_rotary(q, cos, sin), apply_interleaved_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, d).to(x.dtype))


class DiTFeedForward(nn.Module):
    def __init__(self, dim: int, mult: float) -> None:
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
            nn.Identity(),
            nn.Linear(inner, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, shape: DiTShape) -> None:
        super().__init__()
        self.norm1 = DiTRMSNorm(shape.hidden_size)
        self.attn = DiTAttention(shape.hidden_size, shape.num_heads)
        self.norm2 = DiTRMSNorm(shape.hidden_size)
        self.mlp = DiTFeedForward(shape.hidden_size, shape.mlp_ratio)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm_final = DiTRMSNorm(dim)
        self.linear = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm_final(x))


class TimestepEmbedder(nn.Module):
    """Sinusoid of 1000·τ over 256 channels (sin half, then cos half) → Linear, SiLU, Linear."""

    FREQ_DIM = 256

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(self.FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.FREQ_DIM // 2
        freqs = torch.exp(
            torch.arange(half, device=t.device, dtype=torch.float32) * -(math.log(10000) / (half - 1))
        )
        args = 1000.0 * t.float()[:, None] * freqs[None, :]
        return self.time_mlp(torch.cat((args.sin(), args.cos()), dim=-1).to(self.time_mlp[0].weight.dtype))


class CondEmbedder(nn.Module):
    def __init__(self, cond_dim: int, dim: int) -> None:
        super().__init__()
        self.cond_embedder = nn.Linear(cond_dim, dim)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return self.cond_embedder(c)


class FlowDiT(nn.Module):
    """`cfm.model`: sequence [t_emb(τ) + c_emb ; x_emb(history) ; x_emb(y)] → velocity of the last patch."""

    def __init__(self, shape: DiTShape, cond_dim: int) -> None:
        super().__init__()
        d = shape.hidden_size
        self.t_embedder = TimestepEmbedder(d)
        self.x_embedder = nn.Linear(shape.in_channels, d)
        self.c_embedder = CondEmbedder(cond_dim, d)
        self.rotary_embed = InterleavedRotary(shape.head_dim)
        self.blocks = nn.ModuleList(DiTBlock(shape) for _ in range(shape.depth))
        self.final_layer = FinalLayer(d, shape.in_channels)

    def run_blocks(self, seq: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            seq = block(seq, cos, sin)
        return seq

    @torch.no_grad()
    def plan(
        self, times: torch.Tensor, history_len: int, patch: int, device: torch.device | str
    ) -> SamplePlan:
        """What a sample at these times and lengths reuses: time embeddings, step sizes, rotary tables.
        `times` [steps + 1] float32 (`sway_times`; keep it on the host: the step sizes are read as floats).

        Made once per runner, it keeps the sampling loop free of host→device copies (a CUDA graph
        captures the loop alone)."""
        cos, sin = self.rotary_embed.cos_sin(1 + history_len + patch)
        t_emb = self.t_embedder(times[:-1].to(device))[:, None, None]  # [steps, 1, 1, D]
        dts = tuple(float(times[k + 1] - times[k]) for k in range(len(times) - 1))
        return SamplePlan(t_emb, dts, cos, sin)

    @torch.no_grad()
    def sample_planned(
        self,
        plan: SamplePlan,
        cond: torch.Tensor,
        history: torch.Tensor,
        noise: torch.Tensor,
        cfg_strength: float,
        sde_noise: torch.Tensor | None = None,
        sde_scale: float = 0.0,
    ) -> torch.Tensor:
        """One patch per row: cond [B, cond_dim] (LM hidden), history [B, H, C], noise [B, P, C] → [B, P, C] float32.

        `sde_noise` [steps, B, P, C] with `sde_scale` = σ·√temperature adds the reference's stochastic
        term; None (temperature 0) is pure Euler. With its plan made already (`plan`): device work only,
        no host sync, fixed shapes.
        """
        dtype = self.x_embedder.weight.dtype
        patch = noise.shape[1]
        c_emb = self.c_embedder(cond.to(dtype))[:, None]
        null = self.c_embedder.cond_embedder.bias.expand_as(c_emb)  # the embedding of a zero condition
        cond2 = torch.cat((c_emb, null))
        hist = self.x_embedder(history.to(dtype))
        hist2 = torch.cat((hist, hist))
        y = noise.float()
        for k, dt in enumerate(plan.dts):
            x = self.x_embedder(y.to(dtype))
            seq = torch.cat((plan.t_emb[k] + cond2, hist2, torch.cat((x, x))), dim=1)
            v = self.final_layer(self.run_blocks(seq, plan.cos, plan.sin)[:, -patch:]).float()
            v_cond, v_null = v.chunk(2)
            y = y + (v_cond + (v_cond - v_null) * cfg_strength) * dt
            if sde_noise is not None and sde_scale:
                y = y + sde_scale * math.sqrt(abs(dt)) * sde_noise[k].float()
        return y


class Aggregator(nn.Module):
    """`aggregator`: a learned CLS row + x_emb(patch) → blocks → RMSNorm + Linear; the CLS row's output."""

    def __init__(self, shape: DiTShape, out_dim: int) -> None:
        super().__init__()
        d = shape.hidden_size
        self.word_embedder = nn.Embedding(1, d)
        self.x_embedder = nn.Linear(shape.in_channels, d)
        self.rotary_embed = InterleavedRotary(shape.head_dim)
        self.blocks = nn.ModuleList(DiTBlock(shape) for _ in range(shape.depth))
        self.final_layer = FinalLayer(d, out_dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, P, C] → one LM input embedding per patch [N, out_dim]."""
        x = self.x_embedder(patches.to(self.x_embedder.weight.dtype))
        cls = self.word_embedder.weight[None].expand(x.shape[0], 1, -1)
        x = torch.cat((cls, x), dim=1)
        cos, sin = self.rotary_embed.cos_sin(x.shape[1])
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.final_layer(x[:, 0])
