"""Streaming detokenization: token ids in, complete UTF-8 text deltas out, stop strings applied.

Byte-level BPE tokens may split a character (a Chinese character or an emoji spans 3-4 bytes,
often several tokens); a decode that ends in U+FFFD is an incomplete character, so its text waits
for the next token. A few prompt tokens seed the context so word-boundary spaces decode right.
Special tokens (`<|reserved_token_5|>`, `<tool_call>`) are left out of the text unless the request
keeps them (SamplingParams.keep_special_tokens), as vLLM's skip_special_tokens; the ids keep them.
"""

from __future__ import annotations

from typing import Protocol

from omnistage.services.thinker.engine.stop import StopStringMatcher

_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


class Detokenizer:
    """Per-request incremental decoder; `add` returns the new text that is safe to show."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        *,
        keep_special: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = not keep_special
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the window re-decoded for context
        self.read_offset = len(self.ids)  # tokens before this are already turned into text
        self.matcher = StopStringMatcher(stop)
        self.text = ""  # everything emitted so far

    @property
    def stopped(self) -> bool:
        """A stop string matched; the request should end with FinishReason.STOP_STRING."""
        return self.matcher.stopped

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._emit(self.matcher.feed(self._decode_new()))

    def finish(self) -> str:
        """Flush on a non-stop-string end: undecodable bytes as U+FFFD and held-back stop prefixes."""
        tail = ""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            tail = self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.ids)
        return self._emit(self.matcher.feed(tail) + self.matcher.flush())

    def _decode_new(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _emit(self, delta: str) -> str:
        self.text += delta
        return delta
