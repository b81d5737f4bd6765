"""The OpenAI field a refusal of the Omni call is about, read from the Omni field its message names.

The gateway and its stages refuse a request as "<Omni field>: why" (a stage's refusal prefixed with
the stage's name: "thinker: sampling.max_tokens: ..."); the error's `param` is the body field the
client wrote, which the route knows: `voice` is `audio.voice` in a chat body, the prompt's
context-length refusal is about `messages` in chat and `prompt` in completions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# (Omni field path, its OpenAI param), first match wins; `{name}` is the route's own word (ParamMap.words).
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), param)
    for pattern, param in (
        (r"sampling\.max_tokens", "{max_tokens}"),
        (r"sampling\.constraint(?:\..+)?", "{constraint}"),
        (r"sampling\.logprobs", "{logprobs}"),
        (r"sampling\.(stop)(?:\[\d+\])?", r"\1"),
        (r"sampling\.(\w+)", r"\1"),
        (r"tools\[(\d+)\]\.name", r"tools[\1].function.name"),
        (r"tools\[(\d+)\]\.description", r"tools[\1].function.description"),
        (r"tools\[(\d+)\]\.parameters_json", r"tools[\1].function.parameters"),
        (r"tools(?:\[\d+\])?", "tools"),
        (r"tool_choice(?:_function)?", "tool_choice"),
        (r"messages\[(\d+)\]\.tool_calls\[(\d+)\]\.name", r"messages[\1].tool_calls[\2].function.name"),
        (
            r"messages\[(\d+)\]\.tool_calls\[(\d+)\]\.arguments_json",
            r"messages[\1].tool_calls[\2].function.arguments",
        ),
        (r"messages\[(\d+)\]\.(tool_calls(?:\[\d+\])?|tool_call_id|role)", r"messages[\1].\2"),
        (r"messages\[(\d+)\]\.parts\[(\d+)\]\.text", "{part_text}"),
        (r"messages\[(\d+)\]\.parts(?:\[(\d+)\](?:\..+)?)?", "{part}"),
        (r"messages(?:\[\d+\])?", "{messages}"),
        (r"output_modalities(?:\[\d+\])?", "modalities"),
        (r"voice|custom_voice(?:\..+)?", "{voice}"),
        (r"prompt|prompt_token_ids|chat(?:\..+)?", "{prompt}"),
        (r"token_ids", "tokens"),
        (r"image\.(?:width|height)", "size"),
        (r"image\.steps", "num_inference_steps"),
        (r"image\.(guidance_scale|seed)", r"\1"),
        (r"system_prompt", "{system_prompt}"),
        (r"request_id", "x-request-id"),
    )
)
# The leading words of a message that may name a field: "thinker: prompt: ..." names `prompt`.
_LEAD = re.compile(r"^([\w.\[\]]+): (?:([\w.\[\]]+): )?")


@dataclass(frozen=True)
class ParamMap:
    """A route's reading of Omni field paths: `words` fills the rules' `{name}`s (a missing word: no
    param), `string_content` lists the chat messages whose `content` was a string (one text part)."""

    words: dict[str, str] = field(default_factory=dict)
    string_content: frozenset[int] = frozenset()

    def __call__(self, details: str) -> str | None:
        lead = _LEAD.match(details)
        if lead is None:
            return None
        for path in filter(None, lead.groups()):
            param = self.param(path)
            if param is not None:
                return param
        return None

    def param(self, path: str) -> str | None:
        """The OpenAI param of one Omni field path (None when the route has no such field)."""
        for pattern, template in _RULES:
            m = pattern.fullmatch(path)
            if m is None:
                continue
            if template.startswith("{part"):
                return self._part(int(m[1]), m[2], template == "{part_text}")
            if template.startswith("{"):
                return self.words.get(template[1:-1])
            return m.expand(template)
        return None

    def _part(self, message: int, part: str | None, text: bool) -> str:
        if part is None or message in self.string_content:
            return f"messages[{message}].content"
        return f"messages[{message}].content[{part}]" + (".text" if text else "")


CHAT_WORDS = {"constraint": "response_format", "logprobs": "top_logprobs", "messages": "messages"}
CHAT_WORDS |= {"prompt": "messages", "voice": "audio.voice"}
COMPLETION_WORDS = {"max_tokens": "max_tokens", "logprobs": "logprobs", "prompt": "prompt"}
SPEECH = ParamMap(
    {"max_tokens": "max_tokens", "voice": "voice", "prompt": "input", "system_prompt": "instructions"}
)
IMAGES = ParamMap({"prompt": "prompt", "messages": "prompt"})
TOKENIZE_PROMPT = ParamMap({"prompt": "prompt"})
DETOKENIZE = ParamMap()
