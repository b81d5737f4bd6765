"""Mono PCM16 WAV, the one writer: the 44-byte header (sized, or the streaming form) and whole files."""

from __future__ import annotations

import struct


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """A 44-byte PCM16 mono WAV header; `data_bytes` None gives the streaming form (sizes 0xFFFFFFFF)."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


def wav_bytes(pcm16: bytes, sample_rate: int) -> bytes:
    """Mono PCM16 little-endian samples as a WAV file (what the encoder decodes, what clients save)."""
    return wav_header(sample_rate, len(pcm16)) + pcm16
