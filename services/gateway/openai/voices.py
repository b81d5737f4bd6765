"""OpenAI's voice names, spoken by the talker's default preset (code written for OpenAI keeps working)."""

from __future__ import annotations

# The voices of OpenAI's speech, chat audio and Realtime APIs.
OPENAI_VOICES = frozenset(
    {
        "alloy",
        "ash",
        "ballad",
        "cedar",
        "coral",
        "echo",
        "fable",
        "marin",
        "nova",
        "onyx",
        "sage",
        "shimmer",
        "verse",
    }
)


def omni_voice(name: str) -> str:
    """The Omni `voice` of a requested name: an OpenAI voice is "" (talker.default_voice, a preset of
    the checkpoint); any other name is a preset's own name (the talker refuses one it does not have)."""
    return "" if name in OPENAI_VOICES else name
