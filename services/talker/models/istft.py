"""The AudioVAE's ISTFT head (ming.md §5.4) and its streaming overlap-add state."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class OverlapAddState:
    """One stream's overlap-add tail: the sums of audio and squared window not final yet."""

    audio_tail: torch.Tensor | None = None
    envelope_tail: torch.Tensor | None = None
    frames: int = 0  # frames added so far
    emitted: int = 0  # samples returned so far (after the leading trim)
    done: bool = False


class ISTFT(nn.Module):
    def __init__(self, n_fft: int, hop: int) -> None:
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        # On the CPU even in a meta build (common/checkpoint/loading.py `empty_on` says why).
        self.register_buffer("window", torch.hann_window(n_fft, device="cpu"))

    def init_buffers(self) -> None:
        """float32 Hann window after `to_empty` (the checkpoint's copy is loaded over it)."""
        self.window = torch.hann_window(self.n_fft, device=self.window.device)

    @property
    def pad(self) -> int:
        return (self.n_fft - self.hop) // 2

    def frames(self, spectrum: torch.Tensor) -> torch.Tensor:
        """Complex [..., T, n_fft/2 + 1] → windowed time frames [..., T, n_fft] (float32)."""
        return torch.fft.irfft(spectrum, self.n_fft, dim=-1) * self.window.float()

    def _overlap_add(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Frames [m, n_fft] → (audio sums, squared-window sums), each (m − 1)·hop + n_fft long."""
        m = frames.shape[0]
        length = (m - 1) * self.hop + self.n_fft
        audio = F.fold(frames.T[None], (1, length), (1, self.n_fft), stride=(1, self.hop))[0, 0, 0]
        win2 = self.window.float().square()[:, None].expand(-1, m)
        envelope = F.fold(win2[None], (1, length), (1, self.n_fft), stride=(1, self.hop))[0, 0, 0]
        return audio, envelope

    def stream(self, frames: torch.Tensor, state: OverlapAddState, last: bool) -> torch.Tensor:
        """Add frames [m, n_fft] (m may be 0 when `last`); return the samples that became final."""
        keep = self.n_fft - self.hop
        if frames.shape[0]:
            audio, envelope = self._overlap_add(frames)
            if state.audio_tail is not None:
                audio[:keep] += state.audio_tail
                envelope[:keep] += state.envelope_tail
            start = state.frames * self.hop  # global index of audio[0]
            state.frames += frames.shape[0]
            done_audio, done_env = audio[:-keep], envelope[:-keep]
            state.audio_tail, state.envelope_tail = audio[-keep:], envelope[-keep:]
        else:
            if state.audio_tail is None:
                raise ValueError("istft: the stream ends before any frame")
            start = state.frames * self.hop
            done_audio = done_env = state.audio_tail[:0]
        if last:  # the tail is final too, up to the trailing trim
            done_audio = torch.cat((done_audio, state.audio_tail[: keep - self.pad]))
            done_env = torch.cat((done_env, state.envelope_tail[: keep - self.pad]))
            state.done = True
        skip = max(self.pad - start, 0)  # the leading trim, in this piece
        out = done_audio[skip:] / done_env[skip:]
        state.emitted += out.shape[0]
        return out


class ISTFTHead(nn.Module):
    """`decoder.head`: `out` Linear and the `istft` (its `window` is a checkpoint tensor)."""

    def __init__(self, dim: int, n_fft: int, hop: int) -> None:
        super().__init__()
        self.out = nn.Linear(dim, n_fft + 2)
        self.istft = ISTFT(n_fft, hop)

    def spectrum(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden [..., T, dim] → complex spectrum [..., T, n_fft/2 + 1] (float32 maths)."""
        pred = self.out(hidden).float()
        log_mag, phase = pred.chunk(2, dim=-1)
        mag = torch.exp(log_mag).clamp(max=100.0)
        return torch.polar(mag, phase)

    def decode_whole(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden [T, dim] of a whole sequence → T·hop samples."""
        return self.istft.stream(self.istft.frames(self.spectrum(hidden)), OverlapAddState(), last=True)
