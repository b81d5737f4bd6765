"""The one WAV writer: byte for byte what the standard library's `wave` writes, and the streaming header."""

from __future__ import annotations

import io
import wave

from omnistage.common.wav import wav_bytes, wav_header


def test_a_wav_file_is_what_the_wave_module_writes():
    pcm = bytes(range(256)) * 3
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(22050)
        w.writeframes(pcm)
    assert wav_bytes(pcm, 22050) == buf.getvalue()
    with wave.open(io.BytesIO(wav_bytes(pcm, 44100))) as r:
        assert (r.getnchannels(), r.getsampwidth(), r.getframerate(), r.readframes(10**6)) == (
            1,
            2,
            44100,
            pcm,
        )


def test_the_streaming_header_leaves_the_sizes_open():
    header = wav_header(16000)
    assert len(header) == 44 and header[4:8] == b"\xff\xff\xff\xff" and header[40:44] == b"\xff\xff\xff\xff"
    assert wav_header(16000, 10)[40:44] == (10).to_bytes(4, "little")
