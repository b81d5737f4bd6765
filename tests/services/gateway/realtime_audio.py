"""A speech-like test signal the Silero VAD hears as speech: a voiced source (a pitch-varying harmonic
series) shaped by the formants of English vowels, one vowel per syllable-long swell. Made at test time
(no recording ships)."""

from __future__ import annotations

import numpy as np

# (F1, F2, F3) of /a/, /i/, /o/, /u/, /e/ in Hz.
VOWELS = ((730, 1090, 2440), (270, 2290, 3010), (570, 840, 2410), (300, 870, 2240), (530, 1840, 2480))
SYLLABLE_S = 0.22


def speech_like(seconds: float, rate: int = 24000) -> np.ndarray:
    """float32 in [-0.3, 0.3]."""
    n = int(seconds * rate)
    t = np.arange(n) / rate
    f0 = 130 + 25 * np.sin(2 * np.pi * 1.3 * t) + 10 * np.sin(2 * np.pi * 3.1 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    formants = np.array(VOWELS)[(t // SYLLABLE_S).astype(int) % len(VOWELS)]
    x = np.zeros(n)
    for k in range(1, 36):
        fk = k * f0
        amp = sum(np.exp(-0.5 * ((fk - formants[:, j]) / (80 + 40 * j)) ** 2) / (j + 1) for j in range(3))
        x += (amp + 0.02) * (fk < rate / 2 - 200) * np.sin(k * phase)
    x *= np.sin(np.pi * ((t % SYLLABLE_S) / SYLLABLE_S)) ** 0.6
    return (0.3 * x / np.abs(x).max()).astype(np.float32)


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def silence(seconds: float, rate: int = 24000) -> bytes:
    return b"\x00\x00" * int(seconds * rate)


def utterance(speech_s: float = 0.8, lead_s: float = 0.3, tail_s: float = 0.6, rate: int = 24000) -> bytes:
    """Silence, speech, silence: PCM16 mono."""
    return silence(lead_s, rate) + pcm16(speech_like(speech_s, rate)) + silence(tail_s, rate)
