"""The talker LM's prompt (ming.md §5.2), built with the talker's own tokenizer (`talker/llm/`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omnistage.common.checkpoint.shards import CheckpointError
from tokenizers import Tokenizer

INSTRUCTION = "Please generate speech based on the following description.\n"
SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_pad|>",
    "<|vision_end|>",
    "<audio>",
    "<audioPatch>",
)


@dataclass(frozen=True)
class PromptIds:
    ids: list[int]
    speaker_position: int  # gets spk_head(CAM++ vector)
    audio_position: int  # first of the voice prompt's patch positions (right after <audio>)
    prompt_patches: int


class TalkerPrompt:
    def __init__(self, talker_dir: str | Path) -> None:
        path = Path(talker_dir) / "llm" / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path} not found (the talker's Qwen2 tokenizer)")
        self._tok = Tokenizer.from_file(str(path))
        self._plain = Tokenizer.from_file(str(path))
        self._plain.encode_special_tokens = True
        ids = {}
        for token in SPECIAL_TOKENS:
            got = self._tok.encode(token, add_special_tokens=False).ids
            if len(got) != 1:
                raise CheckpointError(f"{path}: {token} is not one token (got {len(got)} ids)")
            ids[token] = got[0]
        self.special = ids
        self.vocab_size = self._tok.get_vocab_size()
        cfg_path = path.parent / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

    def _markup(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _text(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids if text else []

    def build(self, text: str, prompt_text: str, prompt_patches: int) -> PromptIds:
        s = self.special
        head = (
            self._markup("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
            + self._markup("<|im_start|>user\n")
            + self._markup(INSTRUCTION)
            + self._markup("  speaker_1:")
            + [s["<|vision_start|>"]]
        )
        speaker_position = len(head)
        ids = (
            head
            + [s["<|vision_pad|>"]]
            + self._markup("<|vision_end|>\n")
            + self._markup(" Text input:\n")
            + self._text(prompt_text)
            + self._text(text)
            + self._markup("<|im_end|>\n")
            + self._markup("<|im_start|>assistant\n")
            + [s["<audio>"]]
        )
        audio_position = len(ids)
        ids += [s["<audioPatch>"]] * prompt_patches
        return PromptIds(ids, speaker_position, audio_position, prompt_patches)

    def count(self, text: str) -> int:
        return len(self._text(text))
