"""80-bin Kaldi filterbank features at 16 kHz (torchaudio.compliance.kaldi.fbank's defaults), for CAM++.

25 ms frames every 10 ms (snip_edges), DC offset removed, pre-emphasis 0.97, Povey window, 512-point
power spectrum, 80 triangular mel bins (Kaldi mel scale 1127·ln(1 + f/700)) from 20 Hz to Nyquist,
log with a float32-epsilon floor; no dither. The reference then subtracts the mean over frames.
"""

from __future__ import annotations

import math

import numpy as np

SAMPLE_RATE = 16000
FRAME = 400
SHIFT = 160
FFT = 512
BINS = 80
LOW_HZ = 20.0
PREEMPHASIS = 0.97
_EPS = float(np.finfo(np.float32).eps)


def _mel(f: np.ndarray) -> np.ndarray:
    return 1127.0 * np.log1p(f / 700.0)


def mel_banks(
    bins: int = BINS, low_hz: float = LOW_HZ, rate: int = SAMPLE_RATE, fft: int = FFT
) -> np.ndarray:
    """[bins, fft/2 + 1] triangular weights (the Nyquist column is zero, as Kaldi's)."""
    lo, hi = _mel(np.array(low_hz)), _mel(np.array(rate / 2))
    delta = (hi - lo) / (bins + 1)
    mel = _mel(np.arange(fft // 2) * rate / fft)
    left = lo + np.arange(bins)[:, None] * delta
    center, right = left + delta, left + 2 * delta
    up = (mel[None] - left) / (center - left)
    down = (right - mel[None]) / (right - center)
    weights = np.maximum(0.0, np.minimum(up, down))
    return np.pad(weights, ((0, 0), (0, 1)))


_BANKS = mel_banks()
_WINDOW = (0.5 - 0.5 * np.cos(2 * math.pi * np.arange(FRAME) / (FRAME - 1))) ** 0.85


def kaldi_fbank(wave: np.ndarray) -> np.ndarray:
    """Mono float waveform at 16 kHz → [frames, 80] log-mel energies (float32); 0 frames below 25 ms."""
    wave = np.asarray(wave, dtype=np.float64)
    n = 0 if wave.shape[0] < FRAME else 1 + (wave.shape[0] - FRAME) // SHIFT
    if n == 0:
        return np.zeros((0, BINS), dtype=np.float32)
    idx = np.arange(FRAME)[None, :] + SHIFT * np.arange(n)[:, None]
    frames = wave[idx]
    frames = frames - frames.mean(axis=1, keepdims=True)
    previous = np.concatenate((frames[:, :1], frames[:, :-1]), axis=1)
    frames = (frames - PREEMPHASIS * previous) * _WINDOW
    power = np.abs(np.fft.rfft(frames, n=FFT, axis=1)) ** 2
    return np.log(np.maximum(power @ _BANKS.T, _EPS)).astype(np.float32)
