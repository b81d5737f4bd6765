"""Audio encoder: Whisper-large-v3-style encoder + stride-2 Conv1d projector + L2 norm (ming.md §4.3)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from omnistage.services.encoder.models.config import AudioConfig
from omnistage.services.encoder.models.ops import layer_norm_fp32
from torch import nn


def conv_out_len(n: int | torch.Tensor, stride: int = 2) -> int | torch.Tensor:
    """Length after a kernel-3, padding-1 convolution with `stride`: ⌊(n − 1) / stride⌋ + 1."""
    return (n - 1) // stride + 1


def audio_token_count(mel_frames: int, cfg: AudioConfig | None = None) -> int:
    """Thinker tokens of a clip of `mel_frames` (100 / s): T' = ⌊(T−1)/2⌋+1, T'' = ⌊(T'−1)/2⌋+1."""
    stride = cfg.ds_stride if cfg is not None else 2
    return int(conv_out_len(conv_out_len(mel_frames, 2), stride))


class WhisperAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.n_head, -1).transpose(1, 2) for p in (self.query, self.key, self.value)
        )
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, t, -1))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int) -> None:
        super().__init__()
        self.attn = WhisperAttention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.mlp = nn.Sequential(nn.Linear(n_state, 4 * n_state), nn.GELU(), nn.Linear(4 * n_state, n_state))
        self.mlp_ln = nn.LayerNorm(n_state)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(layer_norm_fp32(self.attn_ln, x).to(x.dtype), mask)
        return x + self.mlp(layer_norm_fp32(self.mlp_ln, x).to(x.dtype))


class WhisperEncoder(nn.Module):
    """`audio.*`: log-mel [B, n_mels, T] (+ lengths) → hidden [B, T', n_state]."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.n_state, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.n_state, cfg.n_state, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", torch.empty(cfg.n_ctx, cfg.n_state))
        self.blocks = nn.ModuleList(
            ResidualAttentionBlock(cfg.n_state, cfg.n_head) for _ in range(cfg.n_layer)
        )
        self.ln_post = nn.LayerNorm(cfg.n_state)

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.conv1.weight.dtype
        x = F.gelu(self.conv1(mel.to(dtype)))
        x = x * _valid(lengths, x.shape[-1])[:, None, :].to(dtype)
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, T', n_state]
        out_lengths = conv_out_len(lengths, 2)
        t = x.shape[1]
        if t > self.cfg.n_ctx:
            raise ValueError(f"audio of {t} positions exceeds the encoder's n_ctx {self.cfg.n_ctx}")
        x = (x + self.positional_embedding[:t]).to(dtype)
        keep = _valid(out_lengths, t)
        mask = None if bool(keep.all()) else keep[:, None, None, :]  # [B, 1, 1, T'] True = attend
        for block in self.blocks:
            x = block(x, mask)
        return layer_norm_fp32(self.ln_post, x).to(dtype), out_lengths


def _valid(lengths: torch.Tensor, t: int) -> torch.Tensor:
    return torch.arange(t, device=lengths.device)[None, :] < lengths[:, None]


class _Transpose(nn.Module):
    """Parameter-free slot of the reference's `linear_proj_audio` Sequential (keeps indices 0 and 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class AudioEncoder(nn.Module):
    """The checkpoint's `audio.*` + `linear_proj_audio.*`: log-mel → L2-normalised thinker-space rows."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.audio = WhisperEncoder(cfg)
        k, s = cfg.ds_kernel_size, cfg.ds_stride
        self.linear_proj_audio = nn.Sequential(
            nn.Conv1d(cfg.n_state, cfg.projector_size, kernel_size=k, stride=s, padding=k // 2),
            _Transpose(),
            nn.GELU(),
            nn.Linear(cfg.projector_size, cfg.projector_size),
        )

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, n_mels, T] right-padded mel + [B] frame counts → ([B, T'', hidden], [B] token counts)."""
        hidden, hidden_lengths = self.audio(mel, lengths)
        hidden = hidden * _valid(hidden_lengths, hidden.shape[1])[:, :, None].to(hidden.dtype)
        conv, _, act, linear = self.linear_proj_audio
        x = linear(act(conv(hidden.transpose(1, 2)).transpose(1, 2)))
        k, s = self.cfg.ds_kernel_size, self.cfg.ds_stride
        tokens = (hidden_lengths + 2 * (k // 2) - k) // s + 1
        return (F.normalize(x, dim=-1) if self.cfg.norm_query_embeds else x), tokens

    def encode_items(self, mels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One batched forward over clips ([n_mels, T_i] each); one [tokens_i, hidden] block per clip."""
        device = self.audio.conv1.weight.device
        lengths = torch.tensor([m.shape[-1] for m in mels], device=device)
        batch = torch.zeros(len(mels), self.cfg.n_mels, int(lengths.max()), device=device)
        for i, m in enumerate(mels):
            batch[i, :, : m.shape[-1]] = m.to(device, non_blocking=True)
        out, tokens = self(batch, lengths)
        return [out[i, : int(n)] for i, n in enumerate(tokens.tolist())]
