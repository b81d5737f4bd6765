"""Vision encoder: Qwen3-VL-style ViT + `linear_proj` + per-token L2 norm (ming.md §3.2)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from omnistage.common.hf_blocks import rotate_half
from omnistage.services.encoder.models.config import VisionConfig
from omnistage.services.encoder.models.ops import layer_norm_fp32
from torch import nn

Grid = tuple[int, int, int]


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = patch: a linear map of each flattened (C, T, P, P) patch."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: PackedLayout
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        return self.proj(packed_attention(q, k, v, layout).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision_config.hidden_act {cfg.hidden_act!r} is not supported")
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: PackedLayout
    ) -> torch.Tensor:
        dtype = self.attn.qkv.weight.dtype
        x = x + self.attn(layer_norm_fp32(self.norm1, x).to(dtype), cos, sin, layout).float()
        return x + self.mlp(layer_norm_fp32(self.norm2, x).to(dtype)).float()


class PatchMerger(nn.Module):
    """LayerNorm per patch, concatenate each 2x2 window, Linear → GELU(erf) → Linear."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool = False) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.merge_unit
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.linear_fc1.weight.dtype
        h = layer_norm_fp32(self.norm, x).to(dtype).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(h)))


class VisionTransformer(nn.Module):
    """`vision.*`: patch embed + interpolated learned positions + 2D rope + blocks + merger.

    The deepstack mergers of the checkpoint are not built: Ming discards their output
    (`use_deepstack=False`), so the loader checks their keys and shapes but does not materialise them.
    """

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self.side = int(round(cfg.num_position_embeddings**0.5))
        if self.side**2 != cfg.num_position_embeddings:
            raise ValueError(
                f"vision_config.num_position_embeddings {cfg.num_position_embeddings} is not a square"
            )
        # On the CPU even in a meta build (common/checkpoint/loading.py `empty_on` says why).
        self.register_buffer("inv_freq", self._inv_freq("cpu"), persistent=False)
        # "auto": flash varlen on CUDA (half precision) where torch has it, else equal-length segments;
        # "segments" / "mask" (the block-diagonal reference) / "flash" force one.
        self.attention = "auto"

    def _inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        half = self.cfg.head_dim // 2  # rows and columns each rotate a quarter-pair of the head
        exponents = torch.arange(0, half, 2, dtype=torch.float32, device=device) / half
        return 1.0 / (self.cfg.rope_theta**exponents)

    def init_buffers(self) -> None:
        """Recompute the float32 rope frequencies after `to_empty` (they are not in the checkpoint)."""
        self.inv_freq = self._inv_freq(self.pos_embed.weight.device)

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """[N, patch_dim] patches of the packed items → merged features [N / 4, out_hidden_size]."""
        grids = [tuple(int(v) for v in g) for g in grids]
        expected = sum(t * h * w for t, h, w in grids)
        if patches.shape[0] != expected:
            raise ValueError(f"{patches.shape[0]} patches for grids {grids} (expected {expected})")
        x = self.patch_embed(patches).float()
        x = x + self._positions(grids)
        cos, sin = self._rope(grids, x.device)
        layout = PackedLayout.of(grids, x.device, self.attention)
        for block in self.blocks:
            x = block(x, cos, sin, layout)
        return self.merger(x)

    def _positions(self, grids: Sequence[Grid]) -> torch.Tensor:
        parts = []
        for t, h, w in grids:
            parts.append(self._interpolated(h, w).repeat(t, 1))
        return torch.cat(parts)

    def _interpolated(self, h: int, w: int) -> torch.Tensor:
        """Bilinear resample (align-corners) of the side x side table to (h, w), float32, merge-window order."""
        table = self.pos_embed.weight
        dev, side, m = table.device, self.side, self.cfg.spatial_merge_size
        hs = torch.linspace(0, side - 1, h, device=dev)
        ws = torch.linspace(0, side - 1, w, device=dev)
        h0, w0 = hs.floor().long(), ws.floor().long()
        h1, w1 = (h0 + 1).clamp(max=side - 1), (w0 + 1).clamp(max=side - 1)
        dh, dw = (hs - h0)[:, None, None], (ws - w0)[None, :, None]
        t = table.float()

        def at(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return t[(r[:, None] * side + c[None, :]).reshape(-1)].view(h, w, -1)

        pe = (
            at(h0, w0) * (1 - dh) * (1 - dw)
            + at(h0, w1) * (1 - dh) * dw
            + at(h1, w0) * dh * (1 - dw)
            + at(h1, w1) * dh * dw
        )
        return pe.view(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)

    def _rope(self, grids: Sequence[Grid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = [], []
        for t, h, w in grids:
            r, c = _block_order_coords(h, w, self.cfg.spatial_merge_size)
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
        r = torch.cat(rows).to(device=device, dtype=torch.float32)
        c = torch.cat(cols).to(device=device, dtype=torch.float32)
        freqs = torch.cat([r[:, None] * self.inv_freq, c[:, None] * self.inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [N, 1 (heads), head_dim]
        return emb.cos(), emb.sin()


@lru_cache(maxsize=256)
def _block_order_coords(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-resolution (row, col) of each patch in (block_row, block_col, in_row, in_col) order."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // m, m, w // m, m)
    return (rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten())


def _segments(grids: Sequence[Grid], device: torch.device) -> list[torch.Tensor]:
    """Attention segments (one per temporal slice of each item), grouped by length into index rows."""
    by_len: dict[int, list[int]] = {}
    start = 0
    for t, h, w in grids:
        for _ in range(t):
            by_len.setdefault(h * w, []).append(start)
            start += h * w
    return [
        torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)[None, :]
        for length, starts in by_len.items()
    ]


def flash_varlen_available(device: torch.device) -> bool:
    """torch's flash-attention kernel (with cu_seqlens) on this device: CUDA builds of torch have it."""
    return device.type == "cuda" and hasattr(torch.ops.aten, "_flash_attention_forward")


def flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Bidirectional flash attention over the packed segments of q, k, v [N, heads, d] (fp16/bf16).

    The aten op `torch.nn.attention.varlen.varlen_attn` itself calls (its positional arguments are the
    same from torch 2.2 on; the wrapper's are not): q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, dropout,
    is_causal, return_debug_mask."""
    q, k, v = (t.contiguous() for t in (q, k, v))  # v is a view of the fused qkv output
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, False, False
    )[0]


@dataclass(frozen=True)
class PackedLayout:
    """Where each attention segment (a temporal slice of an item) lies in the packed sequence, and how
    attention over it runs: `flash` (varlen over cu_seqlens), `segments` (equal-length groups through
    SDPA), or `mask` (one SDPA with a block-diagonal mask: the reference, O(N²) memory)."""

    kind: str
    lengths: tuple[int, ...]  # tokens of each segment, in order (host)
    cu_seqlens: torch.Tensor  # [segments + 1] int32 on the device: 0, then the running sums of lengths
    segments: list[torch.Tensor]  # equal-length index rows (kind "segments")

    @classmethod
    def of(cls, grids: Sequence[Grid], device: torch.device, kind: str = "auto") -> PackedLayout:
        lengths = tuple(h * w for t, h, w in grids for _ in range(t))
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(
            device, non_blocking=True
        )
        if kind == "auto":
            kind = "flash" if flash_varlen_available(device) else "segments"
        return cls(kind, lengths, cu, _segments(grids, device) if kind == "segments" else [])

    @property
    def max_len(self) -> int:
        return max(self.lengths)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """Bidirectional attention within each segment of packed q, k, v [N, heads, d] → [N, heads, d]."""
    if layout.kind == "flash" and q.dtype in (torch.float16, torch.bfloat16):
        return flash_varlen(q, k, v, layout.cu_seqlens, layout.max_len)
    if layout.kind == "mask":
        seg = torch.repeat_interleave(
            torch.arange(len(layout.lengths), device=q.device),
            torch.tensor(layout.lengths, device=q.device),
            output_size=q.shape[0],
        )
        mask = seg[:, None] == seg[None, :]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask
        )
        return out[0].transpose(0, 1)
    segments = layout.segments or _segments([(1, 1, n) for n in layout.lengths], q.device)  # "flash" in fp32
    out = torch.empty_like(q)
    for index in segments:  # [num_segments, length] rows of equal-length segments
        qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))  # [S, heads, L, d]
        out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


class VisionEncoder(nn.Module):
    """The checkpoint's `vision.*` + `linear_proj.*`: patches → L2-normalised thinker-space rows."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTransformer(cfg)
        self.linear_proj = nn.Sequential(
            nn.Linear(cfg.out_hidden_size, cfg.projector_size),
            nn.GELU(),
            nn.Linear(cfg.projector_size, cfg.projector_size),
        )

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        feats = self.vision(patches, grids)
        return F.normalize(self.linear_proj(feats), dim=-1)

    def encode_items(self, patches: Sequence[torch.Tensor], grids: Sequence[Grid]) -> list[torch.Tensor]:
        """One packed forward over several items; one [tokens_i, hidden] block per item."""
        device = self.vision.pos_embed.weight.device
        out = self(torch.cat([p.to(device, non_blocking=True) for p in patches]), grids)
        return list(out.split([t * h * w // self.cfg.merge_unit for t, h, w in grids]))
