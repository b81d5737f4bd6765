"""The base and the field types of the request bodies' pydantic models (bodies.py, chat_body.py), and a
failed validation as OpenAI's 400 naming the field's path (`messages[0].content[1].text`).

Every documented object refuses fields it does not have, at every level (a typo is never silently the
default); types are strict (`"yes"` is no boolean, `"8"` no integer) except that an integral number
(`8.0`, as JavaScript sends numbers) is taken as an integer; text must be Unicode that UTF-8 can carry
(JSON's `"\\ud800"`, a lone surrogate, is refused naming the field, not a 500 deep in the front).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, TypeVar, Union

from omnistage.services.gateway.openai.errors import HttpError, bad_request
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Tag,
    ValidationError,
)
from pydantic_core import PydanticCustomError

# Unknown fields named in one refusal; a body with more says how many it left out.
MAX_NAMED = 8
# Union members are tagged "~name": a tag in an error's location is no field of the body.
_TAG = "~"


class Body(BaseModel):
    """A documented JSON object of a request body."""

    model_config = ConfigDict(extra="forbid", strict=True)


def unicode_problem(text: str) -> str | None:
    """Why UTF-8 cannot carry `text` (a lone UTF-16 surrogate, which JSON's `\\ud800` makes), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid Unicode: a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}) at character {exc.start}"
    return None


def _unicode(value: str) -> str:
    problem = unicode_problem(value)
    if problem is not None:
        raise PydanticCustomError("unicode", problem)
    return value


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and math.isfinite(value) and value.is_integer() else value


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise PydanticCustomError("finite", "expected a finite number, got {value}", {"value": value})
    return value


# Text a model or a stage reads (checked as Unicode); base64 and data URLs are plain str, checked as ASCII
# by their decoding.
Text = Annotated[str, AfterValidator(_unicode)]
Int = Annotated[int, BeforeValidator(_integral)]
Number = Annotated[float, AfterValidator(_finite)]


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def between(lo: float, hi: float) -> AfterValidator:
    """A number in [lo, hi] (both ends included)."""

    def check(value: float) -> float:
        if not lo <= value <= hi:
            raise PydanticCustomError(
                "range",
                "must be in [{lo}, {hi}], got {value}",
                {"lo": _number(lo), "hi": _number(hi), "value": value},
            )
        return value

    return AfterValidator(check)


def one_of(
    members: dict[str, Any], tag_of: Callable[[Any], str | None], expected: str, kind: str = "expected"
) -> Any:
    """A union validated by the one member `tag_of(value)` names (its errors only); when it names
    none, the error (of type `kind`) says `expected`."""
    tagged = tuple(Annotated[member, Tag(_TAG + name)] for name, member in members.items())

    def tag(value: Any) -> str | None:
        name = tag_of(value)
        return None if name is None or name not in members else _TAG + name

    return Annotated[
        Union[tagged],  # noqa: UP007 (a tuple of members, not two operands)
        Discriminator(tag, custom_error_type=kind, custom_error_message=expected),
    ]


def string_or(member: Any, expected: str) -> Any:
    """A string, or `member` (an object or a list)."""

    def tag_of(value: Any) -> str | None:
        if isinstance(value, str):
            return "string"
        return "other" if isinstance(value, dict | list) else None

    return one_of({"string": Text, "other": member}, tag_of, expected)


def by_type(members: dict[str, Any], default: str | None = None) -> Any:
    """An object whose `type` field (absent: `default`) says which member it is (content parts, tools,
    response formats)."""

    def tag_of(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else None
        return kind if isinstance(kind, str) else None

    return one_of(members, tag_of, ", ".join(members), kind="type")


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], data: Any, *, allow_unknown: bool = False) -> M:
    """`data` (a parsed JSON body) as `model`; HttpError 400 naming the first field at fault (every
    unknown field at once). `allow_unknown` (gateway.http_allow_unknown_fields) drops unknown fields
    instead, at every level."""
    for _ in range(2):
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
        unknown = [e for e in errors if e["type"] == "extra_forbidden"]
        if not (allow_unknown and unknown):
            raise refusal(data, errors)
        if len(unknown) < len(errors):
            raise refusal(data, [e for e in errors if e["type"] != "extra_forbidden"])
        for error in unknown:
            _drop(data, error["loc"])
    raise AssertionError("unknown fields dropped, yet refused again")


def refusal(data: Any, errors: list[Any]) -> HttpError:
    """The 400 of a failed validation: every unknown field named (OpenAI's wording), else the first error."""
    unknown = [_path(data, e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return unknown_fields(unknown)
    error = errors[0]
    param = _path(data, error["loc"], missing=error["type"] == "missing") or "body"
    if error["type"] == "type":  # no member of a by_type union has the object's type
        if not isinstance(error["input"], dict):
            return bad_request(param, f"expected an object with a type ({error['msg']})")
        param += ".type"
        got = error["input"].get("type")
        why = "required" if got is None else f"one of {error['msg']}; got {got!r}"
        return bad_request(param, why)
    return bad_request(param, _what(error))


def unknown_fields(names: list[str]) -> HttpError:
    """OpenAI's refusal of fields its schema does not have, naming them (at most MAX_NAMED)."""
    shown = ", ".join(names[:MAX_NAMED])
    if len(names) > MAX_NAMED:
        shown += f" (and {len(names) - MAX_NAMED} more)"
    plural = "s" if len(names) > 1 else ""
    message = f"Unrecognized request argument{plural} supplied: {shown}"
    return HttpError(400, message, param=names[0], code="unknown_parameter")


_JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array"}
_JSON_TYPES |= {dict: "an object", type(None): "null"}
_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean (true or false)",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "a JSON object",
    "model_attributes_type": "a JSON object",
}


def _what(error: Any) -> str:
    kind = error["type"]
    if kind in _EXPECTED:
        got = _JSON_TYPES.get(type(error["input"]), type(error["input"]).__name__)
        return f"expected {_EXPECTED[kind]}, got {got}"
    if kind == "missing":
        return "required"
    if kind == "too_short":
        return f"expected at least {error['ctx']['min_length']} item(s)"
    if kind == "literal_error":
        return f"one of {error['ctx']['expected']}; got {error['input']!r}"
    return str(error["msg"])


def _walk(data: Any, loc: tuple) -> tuple[list[str | int], Any]:
    """The steps of `loc` that are the body's own keys and indexes (union tags left out), and the value
    they reach."""
    steps: list[str | int] = []
    for key in loc:
        if isinstance(data, dict) and isinstance(key, str) and key in data:
            steps.append(key)
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and 0 <= key < len(data):
            steps.append(key)
            data = data[key]
    return steps, data


def _path(data: Any, loc: tuple, *, missing: bool = False) -> str:
    """`loc` in the body's words (`messages[0].content`); a missing field named last."""
    steps, _ = _walk(data, loc)
    if missing and loc and isinstance(loc[-1], str):
        steps.append(loc[-1])
    out = ""
    for step in steps:
        out += f"[{step}]" if isinstance(step, int) else f".{step}" if out else step
    return out


def _drop(data: Any, loc: tuple) -> None:
    """Delete the unknown field at `loc` from the parsed body."""
    _, parent = _walk(data, loc[:-1])
    if isinstance(parent, dict):
        parent.pop(loc[-1], None)
