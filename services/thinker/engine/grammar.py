"""Grammar-constrained sampling (structured outputs) with xgrammar: compile, then mask and advance."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

# "Any JSON object" (OpenAI's json_object), as a schema the strict mode does not narrow.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's messages start with the C++ place they were raised at ("[12:00:01] /x/y.cc:42: ").
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A constraint that does not compile; the message names `sampling.constraint.<kind>`."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asked for: kind "json_object" | "json_schema" | "ebnf", and the grammar's text."""

    kind: str
    text: str = ""


class TokenBytes(Protocol):
    vocab_size: int
    stop_token_ids: tuple[int, ...]

    @property
    def special_tokens(self) -> dict[str, int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def _xgr() -> Any:
    """xgrammar, imported on the first constrained request (it costs ~1 s at start-up otherwise)."""
    import xgrammar

    return xgrammar


@dataclass(eq=False)
class Matcher:
    """One sequence's place in its grammar (xgrammar's matcher) and the tokenizer's vocabulary size."""

    state: Any
    vocab_size: int


@dataclass(eq=False)
class Grammar:
    """A compiled constraint; `matcher()` gives a sequence its own state."""

    spec: GrammarSpec
    compiled: Any = field(repr=False)
    vocab_size: int = 0

    def matcher(self) -> Matcher:
        return Matcher(_xgr().GrammarMatcher(self.compiled), self.vocab_size)


class Grammars:
    """Compiles constraints for one tokenizer (thread-safe; the vocabulary is read at the first use)."""

    def __init__(self, tokenizer: TokenBytes, cache_limit_bytes: int = 256 << 20) -> None:
        self.tokenizer = tokenizer
        self.cache_limit_bytes = cache_limit_bytes
        self._compiler: Any = None
        self._lock = threading.Lock()

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                tok = self.tokenizer
                special = set(tok.special_tokens.values())
                vocab = [b"" if i in special else tok.token_bytes(i) for i in range(tok.vocab_size)]
                info = xgr.TokenizerInfo(
                    vocab,
                    xgr.VocabType.RAW,
                    vocab_size=tok.vocab_size,
                    stop_token_ids=list(tok.stop_token_ids),
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=self.cache_limit_bytes
                )
            return self._compiler

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of `spec` (cached by text); GrammarError with the compiler's message."""
        compiler = self.compiler()
        try:
            if spec.kind == "json_object":
                compiled = compiler.compile_json_schema(
                    JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False
                )
            elif spec.kind == "json_schema":
                compiled = compiler.compile_json_schema(spec.text, any_whitespace=False)
            elif spec.kind == "ebnf":
                compiled = compiler.compile_grammar(spec.text)
            else:
                raise GrammarError(f"sampling.constraint: unknown kind {spec.kind!r}")
        except (RuntimeError, ValueError, TypeError) as exc:
            if isinstance(exc, GrammarError):
                raise
            message = _CPP_PREFIX.sub("", str(exc)).strip()
            raise GrammarError(f"sampling.constraint.{spec.kind}: does not compile: {message}") from None
        return Grammar(spec, compiled, self.tokenizer.vocab_size)


def mask_logits(logits: torch.Tensor, matchers: list[tuple[int, Matcher]]) -> None:
    """In place: in row `i` of each (i, matcher), -inf for every token the grammar does not allow now
    (and for columns past the tokenizer's vocabulary)."""
    if not matchers:
        return
    xgr = _xgr()
    rows = [i for i, _ in matchers]
    vocab_size = matchers[0][1].vocab_size
    bitmask = xgr.allocate_token_bitmask(len(logits), vocab_size)
    for i, matcher in matchers:
        matcher.state.fill_next_token_bitmask(bitmask, i)
    if logits.device.type != "cpu":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    width = min(vocab_size, logits.shape[-1])
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
    if logits.shape[-1] > vocab_size:
        logits[rows, vocab_size:] = float("-inf")


def advance(matchers: list[tuple[int, Matcher]], token_ids: list[int]) -> list[int]:
    """Feed each constrained row its sampled token; the rows whose matcher refused it (never expected:
    the mask allowed only accepted tokens)."""
    return [i for i, matcher in matchers if not matcher.state.accept_token(token_ids[i])]
