"""The Ming chat format (ming.md §7.2): turns → a ChatPrompt of pieces for the thinker.

`<role>SYSTEM</role>{system}\n\ndetailed thinking off<|role_end|><role>HUMAN</role>{content}<|role_end|>`
`<role>ASSISTANT</role>{content}<|role_end|>` … `<role>ASSISTANT</role>` (the generation prompt, always last).
The markup goes in `template` pieces (its role markers become special tokens); the system prompt
and every message text go in `text` pieces, which the thinker encodes as plain text, so a client
cannot forge a turn by writing `<|role_end|><role>SYSTEM</role>`.

Media parts become template markup holding exactly as many placeholder tokens as the encoder made
rows (ming.md §3.5, §4.3, §7.2; the reference processor's layout):
  image  `<image>` + N×`<imagePatch>` + `</image>\n`
  video  `<video>` + per temporal patch `<{ts:.1f} seconds><image>` + h·w×`<framePatch>` + `</image>` + `</video>`
  audio  `<audio>` + N×`<audioPatch>` + `</audio>`
Consecutive images of one message are joined by `\n`, and so are consecutive audio clips (the
reference writes a content item holding several images as `<IMAGE>\n<IMAGE>`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omnistage.v1 import encoder_pb2, thinker_pb2

DEFAULT_SYSTEM_PROMPT = "你是一个友好的AI助手。"
ROLE_END = "<|role_end|>"
_ROLE_TAG = {"system": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT"}
# The checkpoint's placeholder token names (ming.md §7.1); the thinker checks their ids against the items.
PLACEHOLDER = {"image": "<imagePatch>", "video": "<framePatch>", "audio": "<audioPatch>"}


@dataclass(frozen=True)
class MediaSlot:
    """Where a media part sits in a turn: its kind and its index among the request's media parts."""

    kind: str  # "image" | "video" | "audio"
    index: int


@dataclass(frozen=True)
class AnswerTokens:
    """An earlier answer as the thinker generated it (its token ids, the stop token left out) and its
    text: sent as the ids themselves, so the next prompt repeats exactly what the model saw."""

    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant"
    # A text, or the message's texts, media (and an earlier answer's tokens) in order.
    content: str | tuple[str | MediaSlot | AnswerTokens, ...]

    def parts(self) -> tuple[str | MediaSlot | AnswerTokens, ...]:
        return (self.content,) if isinstance(self.content, str) else self.content


def image_markup(item: encoder_pb2.EncodedItem) -> str:
    return "<image>" + PLACEHOLDER["image"] * item.num_tokens + "</image>\n"


def audio_markup(item: encoder_pb2.EncodedItem) -> str:
    return "<audio>" + PLACEHOLDER["audio"] * item.num_tokens + "</audio>"


def video_markup(item: encoder_pb2.EncodedItem) -> str:
    """One `<image>` block per temporal patch, each after its timestamp."""
    slices = [(g.h * g.w) for g in item.merged_grids for _ in range(g.t)]
    if len(slices) != len(item.timestamps_s) or sum(slices) != item.num_tokens:
        raise ValueError(
            f"video item: {len(slices)} temporal patches of {sum(slices)} tokens, "
            f"{len(item.timestamps_s)} timestamps and {item.num_tokens} rows disagree"
        )
    frames = "".join(
        f"<{ts:.1f} seconds><image>" + PLACEHOLDER["video"] * n + "</image>"
        for n, ts in zip(slices, item.timestamps_s, strict=True)
    )
    return "<video>" + frames + "</video>"


_MARKUP = {"image": image_markup, "video": video_markup, "audio": audio_markup}


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

    def tokens(self, ids: tuple[int, ...]) -> None:
        if ids:
            self._flush()
            self.pieces.append(thinker_pb2.PromptPiece(tokens=thinker_pb2.TokenIds(ids=ids)))

    def done(self) -> thinker_pb2.ChatPrompt:
        self._flush()
        return thinker_pb2.ChatPrompt(pieces=self.pieces)

    def _flush(self) -> None:
        if self._markup:
            self.pieces.append(thinker_pb2.PromptPiece(template="".join(self._markup)))
            self._markup = []


def build_chat(
    turns: Sequence[Turn],
    system_prompt: str = "",
    thinking: bool = False,
    media: Sequence[encoder_pb2.EncodedItem] | None = None,
) -> thinker_pb2.ChatPrompt:
    """A conversation whose last turn is the user's, ending with the assistant's generation prompt.

    `media[slot.index]` is the encoder's output for each MediaSlot; None leaves media out (only
    to measure the prompt's text and markup)."""
    if not turns or turns[-1].role != "user":
        raise ValueError("the last turn must be the user's")
    mode = "detailed thinking on" if thinking else "detailed thinking off"
    out = _Pieces()
    out.template("<role>SYSTEM</role>")
    out.text(system_prompt or DEFAULT_SYSTEM_PROMPT)
    out.template(f"\n\n{mode}{ROLE_END}")
    for turn in turns:
        out.template(f"<role>{_ROLE_TAG[turn.role]}</role>")
        previous: str | None = None
        for part in turn.parts():
            if isinstance(part, str):
                out.text(part)
                previous = None
                continue
            if isinstance(part, AnswerTokens):
                out.tokens(part.ids)
                previous = None
                continue
            if previous == part.kind and part.kind in ("image", "audio"):
                out.template("\n")  # several images (clips) of one message
            if media is not None:
                out.template(_MARKUP[part.kind](media[part.index]))
            previous = part.kind
        out.template(ROLE_END)
    out.template("<role>ASSISTANT</role>")
    return out.done()


def prompt_chars(chat: thinker_pb2.ChatPrompt) -> int:
    """Characters of the whole prompt, markup included (so empty turns are not free); a token piece
    counts one per token (no token is shorter)."""
    return sum(len(p.template) + len(p.text) + len(p.tokens.ids) for p in chat.pieces)


def render(chat: thinker_pb2.ChatPrompt) -> str:
    """The prompt as one string (logs and tests; never tokenize this for client text); a token piece
    shows as `<tokens:1,2,3>`."""
    return "".join(
        p.template or p.text or f"<tokens:{','.join(map(str, p.tokens.ids))}>" for p in chat.pieces
    )
