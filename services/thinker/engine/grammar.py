"""Grammar-constrained sampling (structured outputs) with xgrammar: what a constraint is, how it
compiles for one tokenizer, and a sequence's place in it. Compiles of clients' constraints run in
the compile server (grammar_compiles.py); the per-step masks are grammar_masks.py's."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

# "Any JSON object" (OpenAI's json_object), as a schema the strict mode does not narrow.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
KINDS = ("json_object", "json_schema", "ebnf")
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


def xgr() -> Any:
    """xgrammar, imported on first use (it costs seconds: it brings torch and transformers)."""
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
        return Matcher(xgr().GrammarMatcher(self.compiled), self.vocab_size)


def tokenizer_info(tok: TokenBytes) -> Any:
    """xgrammar's view of the vocabulary: every token's bytes (special tokens never match text).
    Seconds of Python for a real vocabulary, holding the GIL: made once, at start-up."""
    x = xgr()
    special = set(tok.special_tokens.values())
    vocab = [b"" if i in special else tok.token_bytes(i) for i in range(tok.vocab_size)]
    return x.TokenizerInfo(
        vocab, x.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=list(tok.stop_token_ids)
    )


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """`spec` compiled by an xgrammar GrammarCompiler; GrammarError with the compiler's message."""
    try:
        if spec.kind == "json_object":
            return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.text, any_whitespace=False)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.text)
    except (RuntimeError, ValueError, TypeError) as exc:
        message = _CPP_PREFIX.sub("", str(exc)).strip()
        raise GrammarError(f"sampling.constraint.{spec.kind}: does not compile: {message}") from None
    raise GrammarError(f"sampling.constraint: unknown kind {spec.kind!r}")


class Grammars:
    """Compiles constraints in this process, cached by text (benchmarks and tests; the thinker
    compiles clients' constraints in its compile server, grammar_compiles.py)."""

    def __init__(self, tokenizer: TokenBytes, cache_limit_bytes: int = 256 << 20) -> None:
        self.tokenizer = tokenizer
        self.cache_limit_bytes = cache_limit_bytes
        self._compiler: Any = None
        self._lock = threading.Lock()

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr().GrammarCompiler(
                    tokenizer_info(self.tokenizer), max_threads=1, cache_limit_bytes=self.cache_limit_bytes
                )
            return self._compiler

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of `spec`; GrammarError with the compiler's message."""
        return Grammar(spec, compile_spec(self.compiler(), spec), self.tokenizer.vocab_size)
