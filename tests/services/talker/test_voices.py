"""Voices: the Kaldi fbank, CAM++ through onnxruntime, reference clips, voice prompts, silence trimming."""

from __future__ import annotations

import io
import math
import wave

import numpy as np
import onnx
import pytest
import torch
from omnistage.services.talker.fbank import kaldi_fbank
from omnistage.services.talker.reference_audio import ClipError, decode_clip
from omnistage.services.talker.silence import SilenceTrimmer
from omnistage.services.talker.speaker import SpeakerEncoder
from omnistage.services.talker.voices import build_voice, prepare_clip, read_presets


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def tone(seconds: float, rate: int, hz: float = 300.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return 0.4 * np.sin(2 * math.pi * hz * t) + 0.01 * np.random.default_rng(0).standard_normal(t.shape)


def test_fbank_frame_follows_the_kaldi_recipe():
    x = tone(0.1, 16000)
    feats = kaldi_fbank(x)
    assert feats.shape == (1 + (1600 - 400) // 160, 80)
    k = 3  # one frame by the recipe, with a plain DFT and triangles built bin by bin
    frame = x[k * 160 : k * 160 + 400].astype(np.float64)
    frame = frame - frame.mean()
    frame = frame - 0.97 * np.concatenate(([frame[0]], frame[:-1]))
    n = np.arange(400)
    frame = frame * (0.5 - 0.5 * np.cos(2 * np.pi * n / 399)) ** 0.85
    padded = np.concatenate((frame, np.zeros(112)))
    freqs = np.arange(257)
    dft = padded @ np.exp(-2j * np.pi * np.outer(np.arange(512), freqs) / 512)
    power = np.abs(dft) ** 2

    def mel(f):
        return 1127 * math.log(1 + f / 700)

    lo, hi = mel(20), mel(8000)
    step = (hi - lo) / 81
    want = []
    for b in range(80):
        left, center, right = lo + b * step, lo + (b + 1) * step, lo + (b + 2) * step
        energy = 0.0
        for i in range(256):
            m = mel(i * 16000 / 512)
            if left < m < right:
                energy += (
                    power[i] * (m - left) / (center - left)
                    if m <= center
                    else power[i] * (right - m) / (right - center)
                )
        want.append(math.log(max(energy, np.finfo(np.float32).eps)))
    np.testing.assert_allclose(feats[k], want, rtol=1e-4, atol=1e-4)


def test_campplus_runs_the_checkpoint_graph_on_mean_normalised_fbank(talker_ckpt):
    path = talker_ckpt / "talker/campplus.onnx"
    enc = SpeakerEncoder(path)
    x = tone(1.0, 16000)
    vec = enc(x)
    w = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    feats = kaldi_fbank(x)
    feats = feats - feats.mean(axis=0)
    want = np.maximum(feats @ w["w1"], 0).mean(axis=0) @ w["w2"]
    assert vec.shape == (192,) and enc.dim == 192
    np.testing.assert_allclose(vec, want, rtol=1e-4, atol=1e-5)


def test_reference_clips_are_decoded_resampled_and_bounded():
    clip = wav_bytes(tone(1.5, 22050), 22050)
    at44 = decode_clip(clip, 44100, 20.0)
    assert abs(at44.shape[0] - 1.5 * 44100) < 200 and at44.dtype == np.float32
    with pytest.raises(ClipError, match="longer than 1 s"):
        decode_clip(clip, 44100, 1.0)
    with pytest.raises(ClipError, match="not a decodable audio file"):
        decode_clip(b"RIFF\x00\x00garbage" * 10, 44100, 20.0)
    with pytest.raises(ClipError, match="empty"):
        decode_clip(b"", 44100, 20.0)
    with pytest.raises(ClipError, match="shorter than 0.1 s"):
        decode_clip(wav_bytes(tone(0.02, 16000), 16000), 44100, 20.0)


def test_a_custom_voice_is_left_padded_to_whole_patches(talker_ckpt, talker_models):
    enc = SpeakerEncoder(talker_ckpt / "talker/campplus.onnx")
    clip = prepare_clip(wav_bytes(tone(1.0, 44100), 44100), enc, 44100, 20.0)
    voice = build_voice(talker_models, "custom", "hello", clip, torch.Generator().manual_seed(0))
    # 44100 samples → 4 patches of 14112 (padded at the start), 4 latents each
    assert voice.patches == 4 and voice.latents.shape == (16, 64) and voice.speaker.shape == (64,)
    again = build_voice(talker_models, "custom", "hello", clip, torch.Generator().manual_seed(0))
    torch.testing.assert_close(voice.latents, again.latents)
    with pytest.raises(ClipError, match="silent"):
        prepare_clip(wav_bytes(np.zeros(44100), 44100), enc, 44100, 20.0)


def test_presets_come_from_voice_name_json(talker_ckpt):
    presets = read_presets(talker_ckpt / "talker")
    assert list(presets) == ["DB30", "lingguang"]
    assert presets["DB30"][0] == "感谢你的认可。" and presets["DB30"][1].name == "prompt.wav"


def test_silence_is_held_until_sound_follows_and_trimmed_at_the_end():
    rate = 1000  # 100-sample frames, 300 samples kept past the last loud frame
    trim = SilenceTrimmer(rate)
    loud, quiet = np.full(100, 0.5, np.float32), np.zeros(100, np.float32)
    # What the end keeps whatever follows (0.3 s past the last loud frame) goes at once; past it, held.
    assert trim.push(np.concatenate((loud, quiet, quiet)), last=False).shape == (300,)
    assert trim.push(np.concatenate((quiet, quiet, quiet)), last=False).shape == (100,)
    assert trim.push(loud, last=False).shape == (300,)  # the held silence goes out before the sound
    out = trim.push(np.concatenate((quiet,) * 6), last=True)
    assert out.shape == (300,) and not out.any()  # 0.3 s of the trailing silence kept


def test_a_segments_first_chunk_is_never_held():
    rate = 1000
    for first in (np.zeros(250, np.float32), np.full(250, 0.5, np.float32)):  # silent or not, not whole
        assert SilenceTrimmer(rate).push(first, last=False).shape == (250,)


def test_trimming_in_chunks_sends_the_samples_of_trimming_at_once():
    rate, gen = 1000, np.random.default_rng(0)
    for _ in range(200):
        audio = np.zeros(int(gen.integers(1, 3000)), np.float32)
        for start in gen.integers(0, audio.size, size=int(gen.integers(0, 4))):  # bursts of sound
            audio[start : start + int(gen.integers(1, 400))] = 0.5
        cuts = np.sort(gen.integers(0, audio.size, size=int(gen.integers(0, 8))))
        trim = SilenceTrimmer(rate)
        pieces = np.split(audio, cuts)
        got = [trim.push(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        want = SilenceTrimmer(rate).push(audio, last=True)
        np.testing.assert_array_equal(np.concatenate(got), want)
