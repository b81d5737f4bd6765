"""The Ming chat format (ming.md §7.2): turns → one prompt string for the thinker.

`<role>SYSTEM</role>{system}\n\ndetailed thinking off<|role_end|><role>HUMAN</role>…<|role_end|>`
`<role>ASSISTANT</role>…<|role_end|>` … `<role>ASSISTANT</role>` (the generation prompt, always last).
The role markers are special tokens of the checkpoint's tokenizer; the thinker tokenizes the string.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SYSTEM_PROMPT = "你是一个友好的AI助手。"
ROLE_END = "<|role_end|>"
_ROLE_TAG = {"system": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT"}


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant"
    text: str


def build_prompt(turns: list[Turn], system_prompt: str = "", thinking: bool = False) -> str:
    """Render a conversation whose last turn is the user's, ending with the assistant's generation prompt."""
    if not turns or turns[-1].role != "user":
        raise ValueError("the last turn must be the user's")
    system = system_prompt or DEFAULT_SYSTEM_PROMPT
    mode = "detailed thinking on" if thinking else "detailed thinking off"
    parts = [f"<role>SYSTEM</role>{system}\n\n{mode}{ROLE_END}"]
    for turn in turns:
        parts.append(f"<role>{_ROLE_TAG[turn.role]}</role>{turn.text}{ROLE_END}")
    parts.append("<role>ASSISTANT</role>")
    return "".join(parts)
