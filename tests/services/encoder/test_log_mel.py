"""Our log-mel against transformers' WhisperFeatureExtractor(feature_size=128) on the same waveform.

The extractor pads to 30 s by default; Ming does not pad. Compared two ways: with padding="longest"
(no padding for one clip: every frame), and with the default 30 s padding on the frames whose whole
400-sample window lies in the clip (a window reaching past the end sees zeros there, where the
un-padded STFT reflects the clip). Its numpy path computes in float64, so that comparison allows
float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers  # a dev dependency: the reference must be there, never skipped
from omnistage.services.encoder.preprocess import log_mel, mel_filters


@pytest.fixture(scope="module")
def extractor():
    return transformers.WhisperFeatureExtractor(feature_size=128)


def _wave(seconds: float, extra: int, seed: int) -> np.ndarray:
    t = np.arange(int(16000 * seconds) + extra) / 16000
    loud_middle = np.exp(-((t - seconds / 2) ** 2))
    chirp = 0.5 * np.sin(2 * np.pi * 300 * t * (1 + t)) * loud_middle
    return (chirp + 0.01 * np.random.default_rng(seed).standard_normal(t.size)).astype(np.float32)


def test_mel_filters_equal_the_extractors(extractor):
    assert np.abs(extractor.mel_filters.T - mel_filters(128).numpy()).max() < 1e-7


@pytest.mark.parametrize(("seconds", "extra"), [(1.0, 0), (2.5, 77), (3.0, 159)])
def test_log_mel_matches_whisper_feature_extractor(extractor, seconds, extra):
    x = _wave(seconds, extra, seed=extra)
    ours = log_mel(torch.from_numpy(x), 128)
    frames = x.size // 160
    assert ours.shape == (128, frames)
    unpadded = extractor(
        x, sampling_rate=16000, padding="longest", truncation=False, return_tensors="pt"
    ).input_features[0]
    assert unpadded.shape == ours.shape
    assert torch.allclose(ours, unpadded, atol=1e-5)
    padded = extractor(x, sampling_rate=16000, return_tensors="pt").input_features[0]
    assert padded.shape == (128, 3000)
    inside = (x.size - 200) // 160 + 1  # frame i's window is [160 i − 200, 160 i + 200)
    assert torch.allclose(ours[:, :inside], padded[:, :inside], atol=1e-5)
    numpy_path = extractor._np_extract_fbank_features(x[None], "cpu")[0]
    assert np.abs(ours.numpy() - numpy_path).max() < 2e-4
