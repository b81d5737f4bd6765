"""The server VAD (Silero's ONNX model through onnxruntime) on 24 kHz PCM16: speech start and end at
the right places, silence and a steady tone are no speech, the protocol's knobs are applied; and the
PCM16 resampler keeps the length of a stream converted in chunks."""

from __future__ import annotations

import asyncio

import numpy as np
from omnistage.services.gateway.openai.pcm import Pcm16Resampler
from omnistage.services.gateway.openai.vad import FRAME_MS, TurnDetector, VadSettings

from tests.services.gateway.realtime_audio import pcm16, silence, utterance


def _feed_all(detector: TurnDetector, pcm: bytes, chunk: int = 4800):
    async def go():
        events = []
        for at in range(0, len(pcm), chunk):
            events += await detector.feed(pcm[at : at + chunk])
        return events

    return asyncio.run(go())


def test_speech_between_silences_starts_and_stops_once_where_it_is():
    events = _feed_all(TurnDetector(VadSettings(silence_duration_ms=300), 24000), utterance(0.8, 0.5, 0.8))
    assert [e.started for e in events] == [True, False]
    start, end = events[0].ms, events[1].ms
    assert 500 - 2 * FRAME_MS <= start <= 500 + 4 * FRAME_MS
    assert 1300 - 6 * FRAME_MS <= end <= 1300 + 4 * FRAME_MS


def test_silence_and_a_steady_tone_are_no_speech():
    t = np.arange(24000 * 2) / 24000
    tone = pcm16(0.3 * np.sin(2 * np.pi * 440 * t).astype(np.float32))
    assert _feed_all(TurnDetector(VadSettings(), 24000), silence(2.0) + tone) == []


def test_a_short_pause_is_not_the_end_with_a_long_silence_duration():
    two_words = utterance(0.6, 0.3, 0.25) + utterance(0.6, 0.0, 1.2)
    short = _feed_all(TurnDetector(VadSettings(silence_duration_ms=100), 24000), two_words)
    long = _feed_all(TurnDetector(VadSettings(silence_duration_ms=800), 24000), two_words)
    assert [e.started for e in short] == [True, False, True, False]
    assert [e.started for e in long] == [True, False]


def test_a_threshold_of_one_hears_nothing():
    assert _feed_all(TurnDetector(VadSettings(threshold=1.0), 24000), utterance()) == []


def test_resampling_in_chunks_keeps_the_length():
    r = Pcm16Resampler(44100, 24000)
    pcm = pcm16(np.zeros(44100, np.float32))
    out = b"".join(r.convert(pcm[i : i + 4410]) for i in range(0, len(pcm), 4410)) + r.flush()
    assert abs(len(out) // 2 - 24000) <= 2
    assert Pcm16Resampler(24000, 24000).convert(b"\x01\x00") == b"\x01\x00"
