"""Tool calls: the request's tools checked, their constraint, and the model's calls found in its text."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from omnistage.common.runtime.errors import InvalidRequest
from omnistage.v1 import common_pb2, omni_pb2

MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 4096
MAX_TOOL_CALLS = 64
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolPlan:
    """A request's checked tools: each as the chat format shows it (JSON), and the choice."""

    shown: tuple[str, ...]  # the OpenAI tool objects as JSON, one per tool, in order
    schemas: tuple[tuple[str, dict], ...]  # (name, parameters schema)
    choice: int  # omni_pb2.ToolChoice
    function: str = ""

    @property
    def forced(self) -> bool:
        """The answer is one call (REQUIRED or FUNCTION), enforced by the constraint."""
        return self.choice in (omni_pb2.TOOL_CHOICE_REQUIRED, omni_pb2.TOOL_CHOICE_FUNCTION)

    def constraint(self) -> common_pb2.GrammarConstraint:
        """The forced call's JSON Schema: the name of an allowed tool and arguments valid under it."""
        allowed = [
            (n, p)
            for n, p in self.schemas
            if self.choice != omni_pb2.TOOL_CHOICE_FUNCTION or n == self.function
        ]
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, params in allowed
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return common_pb2.GrammarConstraint(json_schema=json.dumps(schema, ensure_ascii=False))


def _parameters(tool: omni_pb2.Tool, where: str) -> dict:
    if not tool.parameters_json:
        return {"type": "object", "properties": {}}
    try:
        params = json.loads(tool.parameters_json)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"{where}.parameters_json: not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise InvalidRequest(f"{where}.parameters_json: must be a JSON Schema object")
    return params


def _shown(tool: omni_pb2.Tool, params: dict | None) -> str:
    """The tool as the chat format's tools block shows it (OpenAI's tool object, as `tojson`)."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if params is not None:
        function["parameters"] = params
    return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


def plan_tools(req: omni_pb2.GenerateRequest, outputs: set[int], prefix: str = "") -> ToolPlan | None:
    """The checked tools of `req` (None without tools, or with TOOL_CHOICE_NONE); InvalidRequest
    naming the field."""
    choice = req.tool_choice
    if choice not in omni_pb2.ToolChoice.values():
        raise InvalidRequest(f"{prefix}tool_choice: unknown value {choice}")
    if not req.tools:
        if choice in (omni_pb2.TOOL_CHOICE_REQUIRED, omni_pb2.TOOL_CHOICE_FUNCTION):
            raise InvalidRequest(f"{prefix}tool_choice: {omni_pb2.ToolChoice.Name(choice)} needs tools")
        return None
    if len(req.tools) > MAX_TOOLS:
        raise InvalidRequest(f"{prefix}tools: {len(req.tools)} tools, at most {MAX_TOOLS}")
    if outputs != {omni_pb2.MODALITY_TEXT}:
        raise InvalidRequest(f"{prefix}tools: text answers only (not with MODALITY_AUDIO or MODALITY_IMAGE)")
    names: set[str] = set()
    shown, schemas = [], []
    for i, tool in enumerate(req.tools):
        where = f"{prefix}tools[{i}]"
        if not _NAME.match(tool.name):
            raise InvalidRequest(f"{where}.name: 1 to 64 of a-z, A-Z, 0-9, _ and -; got {tool.name[:80]!r}")
        if tool.name in names:
            raise InvalidRequest(f"{where}.name: {tool.name!r} is declared twice")
        if len(tool.description) > MAX_DESCRIPTION_CHARS:
            raise InvalidRequest(f"{where}.description: at most {MAX_DESCRIPTION_CHARS} characters")
        names.add(tool.name)
        params = _parameters(tool, where)
        shown.append(_shown(tool, params if tool.parameters_json else None))
        schemas.append((tool.name, params))
    if choice == omni_pb2.TOOL_CHOICE_FUNCTION and req.tool_choice_function not in names:
        raise InvalidRequest(
            f"{prefix}tool_choice_function: {req.tool_choice_function!r} is not one of the tools"
        )
    if choice == omni_pb2.TOOL_CHOICE_NONE:
        return None
    if choice != omni_pb2.TOOL_CHOICE_AUTO and req.sampling.HasField("constraint"):
        raise InvalidRequest(f"{prefix}sampling.constraint: not with a required or named tool choice")
    return ToolPlan(tuple(shown), tuple(schemas), choice, req.tool_choice_function)


def new_call(name: str, arguments: Any) -> omni_pb2.ToolCall:
    return omni_pb2.ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        name=name,
        arguments_json=json.dumps(arguments, ensure_ascii=False),
    )


def parse_call(body: str) -> omni_pb2.ToolCall | None:
    """The call of a block's JSON `{"name": ..., "arguments": {...}}`; None when it is not one."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models quote the object
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return new_call(value["name"], arguments) if isinstance(arguments, dict) else None


def _held(text: str, marker: str) -> int:
    """Characters at the end of `text` that may start `marker` (held back until the next text)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallScanner:
    """Free text (TOOL_CHOICE_AUTO): text outside `<tool_call>` blocks passes on, each block becomes a
    call (a block that is no call passes on as text); whitespace between calls is dropped."""

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False
        self.calls = 0

    def feed(self, text: str) -> list[str | omni_pb2.ToolCall]:
        self.buf += text
        out: list[str | omni_pb2.ToolCall] = []
        while True:
            marker = CLOSE if self.inside else OPEN
            at = self.buf.find(marker)
            if at < 0:
                if not self.inside:
                    keep = _held(self.buf, OPEN)
                    self._text(out, self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                return out
            head, self.buf = self.buf[:at], self.buf[at + len(marker) :]
            if self.inside:
                self._block(out, head)
            else:
                self._text(out, head)
            self.inside = not self.inside

    def finish(self) -> list[str | omni_pb2.ToolCall]:
        """The rest: an unterminated block is a call if its JSON is whole, else text."""
        out: list[str | omni_pb2.ToolCall] = []
        rest, self.buf = self.buf, ""
        if self.inside:
            self.inside = False
            self._block(out, rest, closed=False)
        else:
            self._text(out, rest)
        return out

    def _text(self, out: list, text: str) -> None:
        if text and not (self.calls and not text.strip()):
            out.append(text)

    def _block(self, out: list, body: str, closed: bool = True) -> None:
        call = parse_call(body.strip()) if self.calls < MAX_TOOL_CALLS else None
        if call is None:
            out.append(OPEN + body + (CLOSE if closed else ""))
            return
        self.calls += 1
        out.append(call)


class ForcedCallScanner:
    """A forced call (REQUIRED / FUNCTION): the whole answer is the call's JSON, read at the end; an
    answer cut short (max_tokens) passes on as text."""

    def __init__(self) -> None:
        self.buf = ""
        self.calls = 0

    def feed(self, text: str) -> list[str | omni_pb2.ToolCall]:
        self.buf += text
        return []

    def finish(self) -> list[str | omni_pb2.ToolCall]:
        call = parse_call(self.buf)
        if call is None:
            return [self.buf] if self.buf else []
        self.calls = 1
        return [call]


def _out(request_id: str, item: str | omni_pb2.ToolCall) -> omni_pb2.GenerateEvent:
    if isinstance(item, str):
        return omni_pb2.GenerateEvent(request_id=request_id, text=omni_pb2.TextDelta(text=item))
    return omni_pb2.GenerateEvent(request_id=request_id, tool_call=item)


class ToolEvents:
    """An answer's events with its tool calls as ToolCall events. Each TextDelta keeps its token ids
    and logprobs (its text is what may be shown now); a Finish after calls says TOOL_CALLS."""

    def __init__(self, plan: ToolPlan, request_id: str) -> None:
        self.scanner = ForcedCallScanner() if plan.forced else ToolCallScanner()
        self.request_id = request_id

    def of(self, event: omni_pb2.GenerateEvent) -> list[omni_pb2.GenerateEvent]:
        """What the client gets for `event`, in order (the finish last)."""
        kind = event.WhichOneof("event")
        if kind == "text":
            items = self.scanner.feed(event.text.text) or [""]
            first = items[0]  # the delta itself goes first (with the first text), in the items' order
            event.text.text = first if isinstance(first, str) else ""
            rest = items[1:] if isinstance(first, str) else items
            return [event, *(_out(self.request_id, item) for item in rest)]
        if kind == "finish":
            out = [_out(self.request_id, item) for item in self.scanner.finish()]
            if self.scanner.calls and event.finish.reason in (
                common_pb2.FINISH_REASON_STOP,
                common_pb2.FINISH_REASON_STOP_STRING,
            ):
                event.finish.reason = common_pb2.FINISH_REASON_TOOL_CALLS
            return [*out, event]
        return [event]
