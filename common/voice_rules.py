"""The rules of a requested voice, checked where a request enters (the gateway, naming the public
field) and by the talker (its own API, naming `config.*`): one definition, so the two never drift.
Whether a preset exists, and whether a clip decodes, only the talker can tell."""

from __future__ import annotations

MAX_VOICE_CHARS = 256


def voice_name_problem(voice: str) -> str | None:
    """What is wrong with a preset voice name, as "<field>: <rule>" (None: nothing)."""
    if len(voice) > MAX_VOICE_CHARS or not voice.isprintable():
        return f"voice: a preset voice name, at most {MAX_VOICE_CHARS} printable characters"
    return None


def custom_voice_problem(audio: bytes, transcript: str) -> str | None:
    """What is missing from a cloned voice (a clip and what it says), as "<field>: <rule>" (None: nothing)."""
    if not audio:
        return "custom_voice.audio: required (an encoded audio clip of the voice)"
    if not transcript.strip():
        return "custom_voice.transcript: required (what the clip says)"
    return None
