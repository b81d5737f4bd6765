"""The one set of rules for sampling parameters, used by the gateway, the thinker and the engine.

Each rule names its field; a violation reads `sampling.<field>: <rule>, got <value>`, so a client can
fix its request from the message alone. The gateway and the thinker check the proto
(`check_sampling`); the engine's own `SamplingParams` checks its values with `sampling_violation`,
so no path into the engine skips a rule. Comparisons are written so NaN and infinities fail them.
"""

from __future__ import annotations

import itertools
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnistage.common.context_rule import context_violation
from omnistage.common.runtime.errors import InvalidRequest

MIN_TEMPERATURE = 0.01  # below it logits / T overflows float32 (a subnormal T gives NaN)
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
MAX_PRESENCE_PENALTY = 2.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Longest grammar (JSON schema or EBNF text) of SamplingParams.constraint: compiling is work for the
# thinker's compile server, bounded by what it is given.
MAX_GRAMMAR_CHARS = 65536
# Deepest nesting of objects and arrays in a JSON schema's text (a nested object costs two: itself
# and its `properties`): compile time grows much faster than linearly with it (issue 43: 450 levels
# took a minute on a 1.2 k vocabulary); OpenAI takes 10 levels of objects, about 21 here.
MAX_GRAMMAR_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {ord("{"): 1, ord("["): 1, ord("}"): -1, ord("]"): -1}


@dataclass(frozen=True)
class Rule:
    """`ok(value)` must hold for `field`; `text` says the rule to the client."""

    field: str
    ok: Callable[[Any], bool]
    text: str


def _f32(x: float) -> float:
    """`x` as a proto float carries it (0.01 arrives as 0.00999999977…)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _off_or_in(lo: float, hi: float) -> Callable[[float], bool]:
    lo, hi = min(lo, _f32(lo)), max(hi, _f32(hi))
    return lambda v: v == 0 or lo <= v <= hi


RULES: tuple[Rule, ...] = (
    Rule(
        "temperature",
        _off_or_in(MIN_TEMPERATURE, MAX_TEMPERATURE),
        f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}]",
    ),
    Rule("top_p", lambda v: 0 <= v <= 1, "must be in [0, 1] (0 means off)"),
    Rule("top_k", lambda v: v >= 0, "must be >= 0 (0 means off)"),
    Rule("min_p", lambda v: 0 <= v <= 1, "must be in [0, 1] (0 means off)"),
    Rule(
        "repetition_penalty",
        _off_or_in(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
        f"must be 0 (off) or in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]",
    ),
    Rule(
        "presence_penalty",
        lambda v: -MAX_PRESENCE_PENALTY <= v <= MAX_PRESENCE_PENALTY,
        f"must be in [-{MAX_PRESENCE_PENALTY:g}, {MAX_PRESENCE_PENALTY:g}]",
    ),
    Rule("max_tokens", lambda v: v >= 0, "must be >= 0 (0 means the server's default)"),
    Rule("logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
    Rule("stop", lambda v: len(v) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings"),
    Rule(
        "stop_token_ids",
        lambda v: len(v) <= MAX_STOP_TOKEN_IDS,
        f"at most {MAX_STOP_TOKEN_IDS} stop token ids",
    ),
)


def _item_violation(values: Mapping[str, Any], vocab_size: int | None) -> str | None:
    for i, stop in enumerate(values["stop"]):
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            return f"sampling.stop[{i}]: must be 1..{MAX_STOP_CHARS} characters, got {len(stop)}"
    for i, tid in enumerate(values["stop_token_ids"]):
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            where = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
            return f"sampling.stop_token_ids[{i}]: must be a token id ({where}), got {tid}"
    return None


def sampling_violation(
    values: Mapping[str, Any], *, max_model_len: int | None = None, vocab_size: int | None = None
) -> str | None:
    """The first rule `values` (field name → value, as in the proto) breaks, as a message; None if none."""
    for rule in RULES:
        value = values[rule.field]
        if not rule.ok(value):
            shown = len(value) if isinstance(value, Sequence) and not isinstance(value, str) else value
            return f"sampling.{rule.field}: {rule.text}, got {shown!r}"
    if max_model_len is not None:
        error = context_violation(max_model_len, max_tokens=values["max_tokens"], prompt_tokens=0)
        if error is not None:
            return error
    return _item_violation(values, vocab_size)


def proto_values(s: Any) -> dict[str, Any]:
    """The ruled fields of a `omnistage.v1.SamplingParams` message."""
    return {rule.field: getattr(s, rule.field) for rule in RULES}


def constraint_violation(s: Any) -> str | None:
    """The shape rules of the proto's `constraint` (a kind set, its text bounded, no ignore_eos); that
    the grammar compiles is the thinker's to find out."""
    if not s.HasField("constraint"):
        return None
    kind = s.constraint.WhichOneof("kind")
    where = f"sampling.constraint.{kind}"
    if kind is None:
        return "sampling.constraint: set json_object, json_schema or ebnf"
    if s.ignore_eos:
        return f"{where}: not with sampling.ignore_eos (a complete output ends with EOS)"
    if kind == "json_object":
        return None if s.constraint.json_object else f"{where}: must be true when set"
    text = getattr(s.constraint, kind)
    if not 1 <= len(text) <= MAX_GRAMMAR_CHARS:
        return f"{where}: must be 1..{MAX_GRAMMAR_CHARS} characters, got {len(text)}"
    if kind == "json_schema" and (depth := json_depth(text)) > MAX_GRAMMAR_DEPTH:
        return (
            f"{where}: objects and arrays nested {depth} deep, at most {MAX_GRAMMAR_DEPTH} "
            "(a property's object counts two: itself and its properties)"
        )
    return None


def json_depth(text: str) -> int:
    """How deep `{` and `[` nest in a JSON text, strings skipped; no parse (a scan at C speed)."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets.encode())), default=0)


def check_sampling(s: Any, *, max_model_len: int | None = None, vocab_size: int | None = None) -> None:
    """Raise InvalidRequest naming `sampling.<field>` when the proto `s` breaks a rule.

    `max_model_len` (when known) bounds max_tokens; `vocab_size` (the thinker's) bounds stop_token_ids.
    """
    error = sampling_violation(proto_values(s), max_model_len=max_model_len, vocab_size=vocab_size)
    if error is None:
        error = constraint_violation(s)
    if error is not None:
        raise InvalidRequest(error)
