"""The Ming chat format (ming.md §7.2): turns → a ChatPrompt of pieces for the thinker."""

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
class ToolCallPart:
    """A call an earlier answer made: rendered after its text as the chat format's `<tool_call>` block."""

    name: str
    arguments: str  # JSON text, as the call gave it


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant" | "tool" (a tool's result: the OBSERVATION turn)
    # A text, or the message's texts, media (and an earlier answer's tokens and tool calls) in order.
    content: str | tuple[str | MediaSlot | AnswerTokens | ToolCallPart, ...]

    def parts(self) -> tuple[str | MediaSlot | AnswerTokens | ToolCallPart, ...]:
        return (self.content,) if isinstance(self.content, str) else self.content


# The tools block of Ling's chat template (the thinker's; ming.md §7.2: it comes after the system
# text, before the thinking switch): fixed wording around one JSON object per tool.
TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
)


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
    tools: Sequence[str] = (),
    call_tool: bool = False,
) -> thinker_pb2.ChatPrompt:
    """A conversation whose last turn is the user's (or tool results), ending with the assistant's
    generation prompt.

    `media[slot.index]` is the encoder's output for each MediaSlot; None leaves media out (only
    to measure the prompt's text and markup). `tools` (each tool's JSON) are shown in the system
    turn; `call_tool` primes the answer with `<tool_call>\n` (a forced call)."""
    if not turns or turns[-1].role not in ("user", "tool"):
        raise ValueError("the last turn must be the user's or tool results")
    mode = "detailed thinking on" if thinking else "detailed thinking off"
    out = _Pieces()
    out.template("<role>SYSTEM</role>")
    out.text(system_prompt or DEFAULT_SYSTEM_PROMPT)
    out.template("\n\n")
    if tools:
        out.template(TOOLS_HEAD)
        for tool in tools:
            out.template("\n")
            out.text(tool)
        out.template(TOOLS_TAIL)
    out.template(f"{mode}{ROLE_END}")
    for i, turn in enumerate(turns):
        if turn.role == "tool":
            _tool_result(out, turn, first=i == 0 or turns[i - 1].role != "tool")
            if i + 1 == len(turns) or turns[i + 1].role != "tool":
                out.template(ROLE_END)
            continue
        out.template(f"<role>{_ROLE_TAG[turn.role]}</role>")
        _turn_parts(out, turn, media)
        out.template(ROLE_END)
    out.template("<role>ASSISTANT</role>")
    if call_tool:
        out.template("<tool_call>\n")
    return out.done()


def _turn_parts(out: _Pieces, turn: Turn, media: Sequence[encoder_pb2.EncodedItem] | None) -> None:
    previous: str | None = None
    written = False  # text before a tool call: the call starts on a new line
    for part in turn.parts():
        if isinstance(part, str):
            out.text(part)
            previous, written = None, written or bool(part)
            continue
        if isinstance(part, AnswerTokens):
            out.tokens(part.ids)
            previous, written = None, True
            continue
        if isinstance(part, ToolCallPart):
            out.template('\n<tool_call>\n{"name": "' if written else '<tool_call>\n{"name": "')
            out.text(part.name)
            out.template('", "arguments": ')
            out.text(part.arguments)
            out.template("}\n</tool_call>")
            previous, written = None, True
            continue
        if previous == part.kind and part.kind in ("image", "audio"):
            out.template("\n")  # several images (clips) of one message
        if media is not None:
            out.template(_MARKUP[part.kind](media[part.index]))
        previous, written = part.kind, True


def _tool_result(out: _Pieces, turn: Turn, first: bool) -> None:
    """One tool result; consecutive results share one OBSERVATION turn."""
    if first:
        out.template("<role>OBSERVATION</role>")
    out.template("\n<tool_response>\n")
    for part in turn.parts():
        if isinstance(part, str):
            out.text(part)
    out.template("\n</tool_response>")


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
