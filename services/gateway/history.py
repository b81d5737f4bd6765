"""The history of one Omni.Converse call: what each answer's prompt is built from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omnistage.services.gateway.prompt import AnswerTokens, MediaSlot, Turn, build_chat, prompt_chars


@dataclass(frozen=True)
class Entry:
    """One turn: a user's text or speech (`pcm16` at `sample_rate_hz`), or an assistant's answer text."""

    role: str  # "user" | "assistant"
    text: str = ""
    pcm16: bytes = b""  # mono little-endian PCM16, as the client sent it (no WAV: the encoder takes it so)
    sample_rate_hz: int = 0
    index: int = -1  # the user turn's number in the call (for error messages); -1 for seeded turns
    token_ids: tuple[int, ...] = ()  # an answer's generated ids (stop token left out); () : send the text


@dataclass(frozen=True)
class Window:
    """The turns of one prompt and its spoken turns, in order (`where` names them in errors)."""

    turns: tuple[Turn, ...]
    audio: tuple[Entry, ...]

    def spoken(self) -> tuple[tuple[str, Entry], ...]:
        return tuple((f"audio (turn {e.index})", e) for e in self.audio)


class History:
    def __init__(self, seeded: Sequence[Entry], max_turns: int) -> None:
        self.entries: list[Entry] = list(seeded)
        self.max_turns = max_turns
        self._trim(max_turns)

    def add(self, entry: Entry) -> None:
        if entry.role == "assistant" and not entry.text:
            return  # an answer interrupted before its first word leaves nothing to remember
        self.entries.append(entry)
        self._trim(self.max_turns)

    def forget_oldest(self) -> bool:
        """Drop the oldest exchange (up to the second user turn); False when only the last turn is left."""
        users = [i for i, e in enumerate(self.entries) if e.role == "user"]
        if len(users) < 2:
            return False
        del self.entries[: users[1]]
        return True

    def window(
        self, system_prompt: str, max_chars: int, max_audio_bytes: int, max_audio_items: int
    ) -> Window:
        """The newest turns that fit the limits, starting at a user turn (the last one at least)."""
        users = [i for i, e in enumerate(self.entries) if e.role == "user"]
        for start in users:
            entries = self.entries[start:]
            spoken = [e for e in entries if e.pcm16]
            if start != users[-1] and (
                len(spoken) > max_audio_items or sum(len(e.pcm16) for e in spoken) > max_audio_bytes
            ):
                continue
            window = _window(entries)
            if start == users[-1] or prompt_chars(build_chat(window.turns, system_prompt)) <= max_chars:
                return window
        raise ValueError("the history has no user turn to answer")

    def _trim(self, max_turns: int) -> None:
        while sum(e.role == "user" for e in self.entries) > max_turns and self.forget_oldest():
            pass


def _window(entries: Sequence[Entry]) -> Window:
    turns, audio = [], []
    for e in entries:
        if e.pcm16:
            turns.append(Turn(e.role, (MediaSlot("audio", len(audio)),)))
            audio.append(e)
        elif e.token_ids:
            turns.append(Turn(e.role, (AnswerTokens(e.token_ids, e.text),)))
        else:
            turns.append(Turn(e.role, e.text))
    return Window(tuple(turns), tuple(audio))
