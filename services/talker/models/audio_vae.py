"""AudioVAE (`talker/vae`, ming.md §5.4): the decoder that turns latents into 44.1 kHz audio, streamed,
and the encoder that makes a voice prompt's latents."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from omnistage.services.talker.models.config import VAEShape
from omnistage.services.talker.models.istft import ISTFTHead, OverlapAddState
from omnistage.services.talker.models.qwen2 import KVSlots, Qwen2Stack, Rows
from torch import nn

# A Qwen2 run over the decoder's cache: (frames [B, T, hidden], slots, starts, lengths) → hidden states.
Backbone = Callable[[torch.Tensor, list[int], list[int], list[int]], torch.Tensor]


@dataclass
class UpsampleState:
    """What the streaming upsampler keeps: the last latent's features and how far it has got."""

    last: torch.Tensor | None = None  # fc1 features of the newest latent [hidden]
    latents: int = 0  # latents seen
    frames: int = 0  # frames produced


def upsample_frames(new: torch.Tensor, state: UpsampleState, scale: int, last: bool) -> torch.Tensor:
    """Frames (fc1 features, [k, hidden]) that the latents so far determine; `new` [m, hidden] (m ≥ 0).

    Frame j interpolates latents at src = max((j + 0.5) / scale − 0.5, 0) (PyTorch's linear upsample,
    align_corners=False, clamped at the right end). Until `last`, a frame is produced only once the
    latent to the right of src exists.
    """
    base = state.latents - 1 if state.last is not None else state.latents
    feats = torch.cat((state.last[None], new)) if state.last is not None else new
    total = state.latents + new.shape[0]
    end = scale * total if last else max(math.ceil(scale * total - scale / 2 - 0.5), 0)
    j = torch.arange(state.frames, end, device=new.device, dtype=torch.float64)
    src = ((j + 0.5) / scale - 0.5).clamp(min=0)
    i0 = src.floor()
    lam = (src - i0)[:, None].to(feats.dtype)
    i0 = i0.long()
    i1 = torch.clamp(i0 + 1, max=total - 1)
    lo = (i0 - base).clamp(0, feats.shape[0] - 1)
    hi = (i1 - base).clamp(0, feats.shape[0] - 1)
    out = feats[lo] * (1 - lam) + feats[hi] * lam
    state.frames = end
    state.latents = total
    if new.shape[0]:
        state.last = new[-1]
    return out


@dataclass
class DecodeStream:
    """One request's decoder state: upsampler, KV slot, overlap-add tail."""

    slot: int
    upsample: UpsampleState = field(default_factory=UpsampleState)
    ola: OverlapAddState = field(default_factory=OverlapAddState)


class VAEDecoder(nn.Module):
    def __init__(self, shape: VAEShape) -> None:
        super().__init__()
        self.shape = shape
        self.fc1 = nn.Linear(shape.latent_dim, shape.decoder.hidden_size)
        self.decoder = Qwen2Stack(shape.decoder, with_embeddings=False)
        self.head = ISTFTHead(shape.decoder.hidden_size, shape.n_fft, shape.dec_hop)

    def new_cache(
        self, num_slots: int, max_frames: int, *, dtype: torch.dtype, device: str | torch.device
    ) -> KVSlots:
        return KVSlots(self.shape.decoder, num_slots, max_frames, dtype=dtype, device=device)

    @torch.no_grad()
    def decode_whole(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [T, C] → T · samples_per_latent samples (no cache: the reference's non-streaming path)."""
        x = self.fc1(latents.to(self.fc1.weight.dtype))
        x = F.interpolate(x.T[None], scale_factor=self.shape.patch_size, mode="linear", align_corners=False)[
            0
        ].T
        hidden = self.decoder(x[None])[0]
        return self.head.decode_whole(hidden)

    @torch.no_grad()
    def decode_step(
        self,
        streams: list[DecodeStream],
        latents: list[torch.Tensor],
        last: list[bool],
        cache: KVSlots,
        backbone: Backbone | None = None,
    ) -> list[torch.Tensor]:
        """Advance several streams in one batched forward: `latents[i]` [m_i, C] (m_i ≥ 0) are stream i's
        new latents, `last[i]` ends it. Returns the samples each stream finished (float32, maybe empty).
        `backbone(x, slots, starts, lengths)` runs the Qwen2 over `cache` instead (the talker's step graphs)."""
        dtype = self.fc1.weight.dtype
        device = self.fc1.weight.device
        counts = [t.shape[0] for t in latents]
        feats = self.fc1(torch.cat(latents).to(device, dtype)) if sum(counts) else None
        frames, offset = [], 0
        for s, n, end in zip(streams, counts, last, strict=True):
            new = (
                feats[offset : offset + n]
                if feats is not None
                else torch.empty(0, self.fc1.out_features, dtype=dtype, device=device)
            )
            offset += n
            frames.append(upsample_frames(new, s.upsample, self.shape.patch_size, end))
        busy = [i for i, f in enumerate(frames) if f.shape[0]]
        outs = [torch.empty(0, device=device) for _ in streams]
        if busy:
            width = max(frames[i].shape[0] for i in busy)
            x = torch.zeros(len(busy), width, self.fc1.out_features, dtype=dtype, device=device)
            for row, i in enumerate(busy):
                x[row, : frames[i].shape[0]] = frames[i]
            starts = [streams[i].upsample.frames - frames[i].shape[0] for i in busy]
            slots, lengths = [streams[i].slot for i in busy], [frames[i].shape[0] for i in busy]
            if backbone is None:
                hidden = self.decoder(x, cache, Rows.of(slots, starts, lengths, device))
            else:
                hidden = backbone(x, slots, starts, lengths)
            framed = self.head.istft.frames(self.head.spectrum(hidden))
            for row, i in enumerate(busy):
                outs[i] = self.head.istft.stream(framed[row, : frames[i].shape[0]], streams[i].ola, last[i])
        for i, s in enumerate(streams):
            if last[i] and i not in busy:
                outs[i] = self.head.istft.stream(torch.empty(0, self.shape.n_fft, device=device), s.ola, True)
        return outs


class VAEEncoder(nn.Module):
    def __init__(self, shape: VAEShape) -> None:
        super().__init__()
        h = shape.encoder.hidden_size
        self.shape = shape
        self.fc1 = nn.Linear(shape.enc_input_dim, h, bias=False)
        self.fc2 = nn.Linear(h, h)
        self.fc3 = nn.Linear(h, 2 * shape.latent_dim)
        self.norm = nn.LayerNorm(h)  # in the checkpoint, unused by the reference's forward
        self.encoder = Qwen2Stack(shape.encoder, with_embeddings=False)
        self.aggregator = Qwen2Stack(shape.encoder_aggregator, with_embeddings=False)
        self.cls_embed = nn.Parameter(torch.zeros(1, 1, h))

    def frames(self, wave: torch.Tensor) -> torch.Tensor:
        """[B, L] → [B, ceil(L / hop), input_dim] (zero padding at the end)."""
        hop, width = self.shape.enc_hop, self.shape.enc_input_dim
        n = (wave.shape[-1] + hop - 1) // hop
        wave = F.pad(wave, (0, (n - 1) * hop + width - wave.shape[-1]))
        return wave.unfold(-1, width, hop)

    @torch.no_grad()
    def moments(self, wave: torch.Tensor) -> torch.Tensor:
        """[B, L] waveform at the VAE rate → [B, ceil(frames / patch), 2 · latent_dim] (mean | scale)."""
        x = self.fc2(self.fc1(self.frames(wave.to(self.fc1.weight.dtype))))
        x = self.encoder(x)
        b, n, h = x.shape
        p = self.shape.patch_size
        x = F.pad(x, (0, 0, 0, (-n) % p)).reshape(-1, p, h)
        x = torch.cat((x, self.cls_embed.expand(x.shape[0], 1, h)), dim=1).reshape(b, -1, h)
        x = self.aggregator(x).reshape(-1, p + 1, h)[:, -1].reshape(b, -1, h)
        return self.fc3(x)

    def latents(self, wave: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """[B, L] → latents [B, T, latent_dim] float32, sampled from the posterior with `generator`."""
        mean, scale = self.moments(wave).float().chunk(2, dim=-1)
        std = F.softplus(scale) + 1e-4
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        return mean + std * eps


class AudioVAE(nn.Module):
    def __init__(self, shape: VAEShape) -> None:
        super().__init__()
        self.shape = shape
        self.encoder = VAEEncoder(shape)
        self.decoder = VAEDecoder(shape)
