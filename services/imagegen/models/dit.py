"""Z-Image DiT (diffusers `ZImageTransformer2DModel`, ming.md §6.2), batched over rows of one shape."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omnistage.services.imagegen.models import fused as kernels
from omnistage.services.imagegen.models.config import DiTConfig
from omnistage.services.imagegen.models.norms import DiffusersRMSNorm
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

SEQ_MULTI_OF = 32
PATCH = 2


def _pad_len(n: int) -> int:
    return (-n) % SEQ_MULTI_OF


class TimestepEmbedder(nn.Module):
    """Sinusoid of t (256 channels, cos first) in float32 → MLP 256 → 1024 → adaLN width."""

    def __init__(self, out_size: int, mid_size: int = 1024, frequency_size: int = 256) -> None:
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_size, mid_size), nn.SiLU(), nn.Linear(mid_size, out_size)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class Attention(nn.Module):
    """Bidirectional self-attention with per-head RMSNorm on q, k and 3-axis RoPE (no biases)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads = cfg.n_heads
        self.to_q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.to_k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.to_v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(cfg.dim, cfg.dim, bias=False)])
        self.norm_q = DiffusersRMSNorm(cfg.head_dim, eps=1e-5)
        self.norm_k = DiffusersRMSNorm(cfg.head_dim, eps=1e-5)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fused: bool = False
    ) -> torch.Tensor:
        b, n, _ = x.shape
        v = self.to_v(x).unflatten(-1, (self.heads, -1))
        if fused:
            q, k = kernels.qk_norm_rope(
                self.to_q(x).unflatten(-1, (self.heads, -1)),
                self.to_k(x).unflatten(-1, (self.heads, -1)),
                self.norm_q.weight,
                self.norm_k.weight,
                self.norm_q.eps,
                *rope,
            )
        else:
            q = self.norm_q(self.to_q(x).unflatten(-1, (self.heads, -1)))
            k = self.norm_k(self.to_k(x).unflatten(-1, (self.heads, -1)))
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.to_out[0](out.transpose(1, 2).reshape(b, n, -1))


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate consecutive channel pairs (complex multiplication) in float32; x [B, N, heads, D], rope's
    cos/sin [B, N, D/2] float32."""
    return kernels.rope_ref(x, *rope)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre/post-RMSNorm block; with `modulation`, adaLN scale and tanh gate from the timestep."""

    def __init__(self, cfg: DiTConfig, modulation: bool) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        self.attention_norm1 = DiffusersRMSNorm(cfg.dim, cfg.norm_eps)
        self.attention_norm2 = DiffusersRMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm1 = DiffusersRMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm2 = DiffusersRMSNorm(cfg.dim, cfg.norm_eps)
        self.modulation = modulation
        if modulation:
            self.adaLN_modulation = nn.Sequential(nn.Linear(cfg.adaln_dim, 4 * cfg.dim))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        adaln: torch.Tensor | None = None,
        fused: bool = False,
    ) -> torch.Tensor:
        if fused:
            return self._fused(x, rope, adaln)
        if not self.modulation:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), rope))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        assert adaln is not None
        scale_a, gate_a, scale_f, gate_f = self.adaLN_modulation(adaln).unsqueeze(1).chunk(4, dim=2)
        gate_a, gate_f = gate_a.tanh(), gate_f.tanh()
        x = x + gate_a * self.attention_norm2(self.attention(self.attention_norm1(x) * (1.0 + scale_a), rope))
        return x + gate_f * self.ffn_norm2(self.feed_forward(self.ffn_norm1(x) * (1.0 + scale_f)))

    def _fused(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], adaln: torch.Tensor | None
    ) -> torch.Tensor:
        """`forward` with each norm + modulation and norm + gate + residual one Triton kernel."""
        scale_a = gate_a = scale_f = gate_f = None
        if self.modulation:
            assert adaln is not None
            scale_a, gate_a, scale_f, gate_f = self.adaLN_modulation(adaln).unsqueeze(1).chunk(4, dim=2)
        eps = self.attention_norm1.eps
        h = kernels.norm_modulate(x, self.attention_norm1.weight, eps, scale_a)
        x = kernels.norm_gate_residual(
            x, self.attention(h, rope, fused=True), self.attention_norm2.weight, eps, gate_a
        )
        h = kernels.norm_modulate(x, self.ffn_norm1.weight, eps, scale_f)
        return kernels.norm_gate_residual(x, self.feed_forward(h), self.ffn_norm2.weight, eps, gate_f)


class FinalLayer(nn.Module):
    """LayerNorm (no affine) × (1 + Linear(SiLU(c))) → Linear to one patch of latent channels."""

    def __init__(self, dim: int, adaln_dim: int, out: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(adaln_dim, dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm_final(x) * (1.0 + self.adaLN_modulation(c)).unsqueeze(1))


class RopeTables(nn.Module):
    """Per-axis cos/sin tables (float32, computed from float64 angles as the reference does)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.axes = len(cfg.axes_dims)
        for a, (d, length) in enumerate(zip(cfg.axes_dims, cfg.axes_lens, strict=True)):
            # On the CPU even in a meta build (common/checkpoint/loading.py `empty_on` says why).
            freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
            angles = torch.outer(torch.arange(length, dtype=torch.float64, device="cpu"), freqs).float()
            self.register_buffer(f"cos{a}", torch.cos(angles), persistent=False)
            self.register_buffer(f"sin{a}", torch.sin(angles), persistent=False)

    def init_buffers(self, cfg: DiTConfig) -> None:
        """Recompute the tables in place (after the module was materialised from meta)."""
        fresh = RopeTables(cfg)
        for name, buf in fresh.named_buffers():
            getattr(self, name).copy_(buf)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [N, 3] int → (cos, sin) [N, head_dim / 2]."""
        cos = [getattr(self, f"cos{a}")[pos[:, a]] for a in range(self.axes)]
        sin = [getattr(self, f"sin{a}")[pos[:, a]] for a in range(self.axes)]
        return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def _grid(f: int, h: int, w: int, start: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    axes = [torch.arange(s, s + n, device=device) for s, n in zip(start, (f, h, w), strict=True)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)


@dataclass
class FirstBlockCache:
    """One DiT row's state for the first-block cache: its first-layer residual and the rest's residual at
    the last full forward, and how many forwards reused them."""

    first: torch.Tensor | None = None  # [S, D]
    rest: torch.Tensor | None = None  # [S, D]
    reused: int = 0


class ZImageDiT(nn.Module):
    """`forward(x [B, C, F, H, W], t [B] in [0, 1], cap [B, L, cap_feat_dim]) → velocity [B, C, F, H, W]`."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        key = f"{PATCH}-1"
        self.all_x_embedder = nn.ModuleDict({key: nn.Linear(cfg.patch_dim, cfg.dim)})
        self.all_final_layer = nn.ModuleDict({key: FinalLayer(cfg.dim, cfg.adaln_dim, cfg.patch_dim)})
        self.noise_refiner = nn.ModuleList(Block(cfg, modulation=True) for _ in range(cfg.n_refiner_layers))
        self.context_refiner = nn.ModuleList(
            Block(cfg, modulation=False) for _ in range(cfg.n_refiner_layers)
        )
        self.t_embedder = TimestepEmbedder(cfg.adaln_dim)
        self.cap_embedder = nn.Sequential(
            DiffusersRMSNorm(cfg.cap_feat_dim, cfg.norm_eps), nn.Linear(cfg.cap_feat_dim, cfg.dim)
        )
        self.x_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg, modulation=True) for _ in range(cfg.n_layers))
        self.rope = RopeTables(cfg)
        # "auto": the fused Triton kernels on CUDA where Triton imports, else torch; "torch" / "triton" force one.
        self.kernels = "auto"
        # SDPA backends to use, in priority order (None: torch's choice, flash on CUDA); the bench times cuDNN's.
        self.sdpa_backends: list[SDPBackend] | None = None

    def fused_for(self, x: torch.Tensor) -> bool:
        if self.kernels == "auto":
            return x.is_cuda and kernels.triton_ok()
        return self.kernels == "triton"

    @property
    def dtype(self) -> torch.dtype:
        return self.x_pad_token.dtype

    def _layers_with_cache(
        self,
        seq: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        adaln: torch.Tensor,
        fused: bool,
        cache: list[FirstBlockCache],
        threshold: float,
    ) -> torch.Tensor:
        """The main layers with a first-block cache: when every row's first-layer residual moved less than
        `threshold` (mean |Δ| / mean |previous|) since the last full forward, the rest of the layers is
        replaced by that forward's residual. One host sync (the decision) per forward."""
        first = self.layers[0](seq, rope, adaln, fused)
        r1 = first - seq
        if all(c.first is not None and c.first.shape == r1.shape[1:] for c in cache):
            prev = torch.stack([c.first for c in cache])
            change = (r1 - prev).abs().flatten(1).float().mean(1) / prev.abs().flatten(1).float().mean(1)
            if float(change.max()) < threshold:
                for c in cache:
                    c.reused += 1
                return first + torch.stack([c.rest for c in cache])
        out = first
        for layer in self.layers[1:]:
            out = layer(out, rope, adaln, fused)
        rest = out - first
        for i, c in enumerate(cache):  # copies: a row's state must not hold its whole batch's tensors
            c.first, c.rest = r1[i].clone(), rest[i].clone()
        return out

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        cap: torch.Tensor,
        cache: list[FirstBlockCache] | None = None,
        threshold: float = 0.0,
    ) -> torch.Tensor:
        """With `cache` (one per row) and `threshold` > 0, the first-block cache (`_layers_with_cache`) is on:
        an approximation, off by default; without, the exact forward."""
        if self.sdpa_backends:
            with sdpa_kernel(self.sdpa_backends, set_priority=True):
                return self._forward(x, t, cap, cache, threshold)
        return self._forward(x, t, cap, cache, threshold)

    def _forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        cap: torch.Tensor,
        cache: list[FirstBlockCache] | None,
        threshold: float,
    ) -> torch.Tensor:
        b, c, f, h, w = x.shape
        ht, wt = h // PATCH, w // PATCH
        n_img, n_cap = f * ht * wt, cap.shape[1]
        pad_img, pad_cap = _pad_len(n_img), _pad_len(n_cap)
        cap_len = n_cap + pad_cap
        key = f"{PATCH}-1"
        adaln = self.t_embedder(t * self.cfg.t_scale).to(x.dtype)
        fused = self.fused_for(x)

        patches = x.view(b, c, f, ht, PATCH, wt, PATCH).permute(0, 2, 3, 5, 4, 6, 1).reshape(b, n_img, -1)
        img = self.all_x_embedder[key](patches)
        img = torch.cat([img, self.x_pad_token.expand(b, pad_img, -1).to(img.dtype)], dim=1)
        img_pos = torch.cat(
            [
                _grid(f, ht, wt, (cap_len + 1, 0, 0), x.device),
                torch.zeros(pad_img, 3, dtype=torch.long, device=x.device),
            ]
        )
        img_rope = tuple(r.expand(b, -1, -1) for r in self.rope(img_pos))
        for layer in self.noise_refiner:
            img = layer(img, img_rope, adaln, fused)

        txt = self.cap_embedder(cap.to(x.dtype))
        txt = torch.cat([txt, self.cap_pad_token.expand(b, pad_cap, -1).to(txt.dtype)], dim=1)
        txt_pos = _grid(cap_len, 1, 1, (1, 0, 0), x.device)
        txt_rope = tuple(r.expand(b, -1, -1) for r in self.rope(txt_pos))
        for layer in self.context_refiner:
            txt = layer(txt, txt_rope, fused=fused)

        seq = torch.cat([img, txt], dim=1)
        rope = tuple(torch.cat([a, bb], dim=1) for a, bb in zip(img_rope, txt_rope, strict=True))
        if cache is not None and threshold > 0:
            seq = self._layers_with_cache(seq, rope, adaln, fused, cache, threshold)
        else:
            for layer in self.layers:
                seq = layer(seq, rope, adaln, fused)
        out = self.all_final_layer[key](seq, adaln)[:, :n_img]
        return out.view(b, f, ht, wt, PATCH, PATCH, c).permute(0, 6, 1, 2, 4, 3, 5).reshape(b, c, f, h, w)
