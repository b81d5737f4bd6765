"""The Ming chat format (ming.md §7.2): turns → a ChatPrompt of pieces for the thinker.

`<role>SYSTEM</role>{system}\n\ndetailed thinking off<|role_end|><role>HUMAN</role>{text}<|role_end|>`
`<role>ASSISTANT</role>{text}<|role_end|>` … `<role>ASSISTANT</role>` (the generation prompt, always last).
The markup goes in `template` pieces (its role markers become special tokens); the system prompt
and every message text go in `text` pieces, which the thinker encodes as plain text, so a client
cannot forge a turn by writing `<|role_end|><role>SYSTEM</role>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.v1 import thinker_pb2

DEFAULT_SYSTEM_PROMPT = "你是一个友好的AI助手。"
ROLE_END = "<|role_end|>"
_ROLE_TAG = {"system": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT"}


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant"
    text: str


class _Pieces:
    """Collects pieces; adjacent template markup is merged into one piece, empty text is skipped."""

    def __init__(self) -> None:
        self.pieces: list[thinker_pb2.PromptPiece] = []
        self._markup: list[str] = []

    def template(self, markup: str) -> None:
        self._markup.append(markup)

    def text(self, text: str) -> None:
        if text:
            self._flush()
            self.pieces.append(thinker_pb2.PromptPiece(text=text))

    def done(self) -> thinker_pb2.ChatPrompt:
        self._flush()
        return thinker_pb2.ChatPrompt(pieces=self.pieces)

    def _flush(self) -> None:
        if self._markup:
            self.pieces.append(thinker_pb2.PromptPiece(template="".join(self._markup)))
            self._markup = []


def build_chat(turns: list[Turn], system_prompt: str = "", thinking: bool = False) -> thinker_pb2.ChatPrompt:
    """A conversation whose last turn is the user's, ending with the assistant's generation prompt."""
    if not turns or turns[-1].role != "user":
        raise ValueError("the last turn must be the user's")
    mode = "detailed thinking on" if thinking else "detailed thinking off"
    out = _Pieces()
    out.template("<role>SYSTEM</role>")
    out.text(system_prompt or DEFAULT_SYSTEM_PROMPT)
    out.template(f"\n\n{mode}{ROLE_END}")
    for turn in turns:
        out.template(f"<role>{_ROLE_TAG[turn.role]}</role>")
        out.text(turn.text)
        out.template(ROLE_END)
    out.template("<role>ASSISTANT</role>")
    return out.done()


def prompt_chars(chat: thinker_pb2.ChatPrompt) -> int:
    """Characters of the whole prompt, markup included (so empty turns are not free)."""
    return sum(len(p.template) + len(p.text) for p in chat.pieces)


def render(chat: thinker_pb2.ChatPrompt) -> str:
    """The prompt as one string (logs and tests; never tokenize this for client text)."""
    return "".join(p.template or p.text for p in chat.pieces)
