"""The KL image VAE (diffusers `AutoencoderKL` layout; 16 latent channels for Z-Image, ming.md §6).

Decoder for every image; encoder (posterior mode) for an edit's reference image. Latent
conventions are the pipeline's: `decode` takes `z / scaling_factor + shift_factor`, `encode` returns
`(mode - shift_factor) · scaling_factor`. Parameter names equal the diffusers checkpoint's.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from omnistage.services.imagegen.models.config import VaeConfig
from torch import nn

EPS = 1e-6


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=EPS)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=EPS)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.conv_shortcut(x) if self.conv_shortcut is not None else x) + h


class SpatialAttention(nn.Module):
    """One head over all positions of the (smallest) feature map, GroupNorm first, residual."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        seq = self.group_norm(x.view(b, c, h * w)).transpose(1, 2)
        q, k, v = (proj(seq).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = self.to_out[0](F.scaled_dot_product_attention(q, k, v).squeeze(1))
        return out.transpose(1, 2).reshape(b, c, h, w) + x


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock(channels, channels, groups), ResnetBlock(channels, channels, groups)]
        )
        self.attentions = nn.ModuleList([SpatialAttention(channels, groups)] if attention else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x)


class Downsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class ResnetStack(nn.Module):
    """diffusers' DownEncoderBlock2D / UpDecoderBlock2D: `layers` resnets, then (all but the last block)
    one downsampler or upsampler, kept under the checkpoint's key (`downsamplers` / `upsamplers`)."""

    def __init__(
        self,
        cin: int,
        cout: int,
        layers: int,
        groups: int,
        resample: Literal["down", "up"],
        with_resampler: bool,
    ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock(cin if i == 0 else cout, cout, groups) for i in range(layers)
        )
        resampler = Downsample if resample == "down" else Upsample
        self.resamplers_key = f"{resample}samplers"
        self.add_module(self.resamplers_key, nn.ModuleList([resampler(cout)] if with_resampler else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for r in self.resnets:
            x = r(x)
        for s in self.get_submodule(self.resamplers_key):
            x = s(x)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: VaeConfig) -> None:
        super().__init__()
        ch, g = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = nn.Conv2d(cfg.in_channels, ch[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            ResnetStack(
                ch[max(i - 1, 0)], ch[i], cfg.layers_per_block, g, "down", with_resampler=i < len(ch) - 1
            )
            for i in range(len(ch))
        )
        self.mid_block = MidBlock(ch[-1], g, cfg.mid_block_add_attention)
        self.conv_norm_out = nn.GroupNorm(g, ch[-1], eps=EPS)
        self.conv_out = nn.Conv2d(ch[-1], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(self.mid_block(x))))


class Decoder(nn.Module):
    def __init__(self, cfg: VaeConfig) -> None:
        super().__init__()
        ch, g = list(reversed(cfg.block_out_channels)), cfg.norm_num_groups
        self.conv_in = nn.Conv2d(cfg.latent_channels, ch[0], 3, padding=1)
        self.mid_block = MidBlock(ch[0], g, cfg.mid_block_add_attention)
        self.up_blocks = nn.ModuleList(
            ResnetStack(
                ch[max(i - 1, 0)], ch[i], cfg.layers_per_block + 1, g, "up", with_resampler=i < len(ch) - 1
            )
            for i in range(len(ch))
        )
        self.conv_norm_out = nn.GroupNorm(g, ch[-1], eps=EPS)
        self.conv_out = nn.Conv2d(ch[-1], cfg.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class AutoencoderKL(nn.Module):
    """`decode(latents)` → image in [-1, 1]; `encode(image in [-1, 1])` → latents (both pipeline-scaled)."""

    def __init__(self, cfg: VaeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        c = 2 * cfg.latent_channels
        self.quant_conv = nn.Conv2d(c, c, 1) if cfg.use_quant_conv else None
        self.post_quant_conv = (
            nn.Conv2d(cfg.latent_channels, cfg.latent_channels, 1) if cfg.use_post_quant_conv else None
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.conv_in.weight.dtype

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(self.dtype) / self.cfg.scaling_factor + self.cfg.shift
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def encode(self, image: torch.Tensor) -> torch.Tensor:
        moments = self.encoder(image.to(self.dtype))
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mode = moments[:, : self.cfg.latent_channels]
        return (mode - self.cfg.shift) * self.cfg.scaling_factor
