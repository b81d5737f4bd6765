"""Tool calls in the gateway: the chat format's tools block, calls and OBSERVATION turns; the checks of
a request's tools; calls read out of streamed text; the forced call's schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.services.gateway.prompt import TOOLS_HEAD, TOOLS_TAIL, render
from omnistage.services.gateway.tools import ForcedCallScanner, ToolCallScanner, ToolEvents, plan_tools
from omnistage.services.gateway.validation import RequestLimits, plan_request
from omnistage.v1 import common_pb2, omni_pb2

WEATHER = omni_pb2.Tool(
    name="weather",
    description="Weather of a city.",
    parameters_json=json.dumps(
        {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}, "required": ["city"]}
    ),
)
CLOCK = omni_pb2.Tool(name="clock")


def text(role: int, t: str, **kw) -> omni_pb2.ChatMessage:
    return omni_pb2.ChatMessage(role=role, parts=[omni_pb2.ContentPart(text=t)], **kw)


def request(*messages, **kw) -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(messages=messages, tools=[WEATHER, CLOCK], **kw)


def plan(req: omni_pb2.GenerateRequest):
    return plan_request(req, {"thinker"}, "", RequestLimits())


def test_the_prompt_shows_tools_calls_and_results_as_the_chat_template_does():
    call = omni_pb2.ToolCall(id="call_1", name="weather", arguments_json='{"city": "Paris"}')
    req = request(
        text(omni_pb2.ROLE_USER, "Weather in Paris?"),
        omni_pb2.ChatMessage(role=omni_pb2.ROLE_ASSISTANT, tool_calls=[call, call]),
        text(omni_pb2.ROLE_TOOL, "sunny", tool_call_id="call_1"),
        text(omni_pb2.ROLE_TOOL, "still sunny", tool_call_id="call_1"),
        system_prompt="Be brief.",
    )
    planned = plan(req)
    shown_weather = json.dumps(
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Weather of a city.",
                "parameters": json.loads(WEATHER.parameters_json),
            },
        }
    )
    block = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert render(planned.chat()) == (
        "<role>SYSTEM</role>Be brief.\n\n"
        + TOOLS_HEAD
        + "\n"
        + shown_weather
        + '\n{"type": "function", "function": {"name": "clock"}}'
        + TOOLS_TAIL
        + "detailed thinking off<|role_end|>"
        "<role>HUMAN</role>Weather in Paris?<|role_end|>"
        "<role>ASSISTANT</role>" + block + "\n" + block + "<|role_end|>"
        "<role>OBSERVATION</role>\n<tool_response>\nsunny\n</tool_response>"
        "\n<tool_response>\nstill sunny\n</tool_response><|role_end|>"
        "<role>ASSISTANT</role>"
    )
    pieces = planned.chat().pieces
    assert any(p.text == "sunny" for p in pieces), "tool results are client text (never markup)"
    assert any(p.text == shown_weather for p in pieces), "tool schemas are client text (never markup)"
    assert not planned.sampling.HasField("constraint"), "auto: the model decides"


@pytest.mark.parametrize(
    ("choice", "function", "kept"),
    [
        (omni_pb2.TOOL_CHOICE_AUTO, "", True),
        (omni_pb2.TOOL_CHOICE_REQUIRED, "", True),
        (omni_pb2.TOOL_CHOICE_FUNCTION, "clock", True),
        (omni_pb2.TOOL_CHOICE_NONE, "", False),
    ],
)
def test_the_thinker_keeps_special_tokens_when_calls_are_read_from_the_answer(choice, function, kept):
    req = request(text(omni_pb2.ROLE_USER, "?"), tool_choice=choice, tool_choice_function=function)
    assert plan(req).sampling.keep_special_tokens is kept, "<tool_call> is a special token"
    assert not req.sampling.keep_special_tokens, "the client's request is left as it was"
    plain = omni_pb2.GenerateRequest(messages=[text(omni_pb2.ROLE_USER, "?")])
    assert not plan(plain).sampling.keep_special_tokens, "no tools: special tokens are left out"


def test_a_forced_call_primes_the_answer_and_constrains_it_to_a_declared_function():
    for choice, function, names in (
        (omni_pb2.TOOL_CHOICE_REQUIRED, "", {"weather", "clock"}),
        (omni_pb2.TOOL_CHOICE_FUNCTION, "clock", {"clock"}),
    ):
        planned = plan(
            request(text(omni_pb2.ROLE_USER, "?"), tool_choice=choice, tool_choice_function=function)
        )
        assert render(planned.chat()).endswith("<role>ASSISTANT</role><tool_call>\n")
        schema = json.loads(planned.sampling.constraint.json_schema)
        for name, args in (("weather", {"city": "Lima"}), ("clock", {})):
            call = {"name": name, "arguments": args}
            if name in names:
                jsonschema.validate(call, schema)
            else:
                with pytest.raises(jsonschema.ValidationError):
                    jsonschema.validate(call, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "weather", "arguments": {"city": "Rome"}}, schema)


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (omni_pb2.GenerateRequest(tools=[omni_pb2.Tool(name="bad name")]), "tools[0].name: 1 to 64 of a-z"),
        (omni_pb2.GenerateRequest(tools=[CLOCK, CLOCK]), "tools[1].name: 'clock' is declared twice"),
        (
            omni_pb2.GenerateRequest(tools=[omni_pb2.Tool(name="f", parameters_json="{")]),
            "tools[0].parameters_json: not valid JSON",
        ),
        (
            omni_pb2.GenerateRequest(
                tools=[CLOCK], tool_choice=omni_pb2.TOOL_CHOICE_FUNCTION, tool_choice_function="nope"
            ),
            "tool_choice_function: 'nope' is not one of the tools",
        ),
        (
            omni_pb2.GenerateRequest(tool_choice=omni_pb2.TOOL_CHOICE_REQUIRED),
            "tool_choice: TOOL_CHOICE_REQUIRED needs tools",
        ),
        (
            omni_pb2.GenerateRequest(tools=[CLOCK], output_modalities=[omni_pb2.MODALITY_AUDIO]),
            "tools: text answers only",
        ),
        (
            omni_pb2.GenerateRequest(
                tools=[CLOCK],
                tool_choice=omni_pb2.TOOL_CHOICE_REQUIRED,
                sampling=common_pb2.SamplingParams(constraint=common_pb2.GrammarConstraint(json_object=True)),
            ),
            "sampling.constraint: not with a required or named tool choice",
        ),
    ],
)
def test_bad_tools_are_refused_naming_the_field(req, needle):
    outputs = set(req.output_modalities) or {omni_pb2.MODALITY_TEXT}
    with pytest.raises(InvalidRequest) as info:
        plan_tools(req, outputs)
    assert str(info.value).startswith(needle)


def test_tool_messages_must_answer_calls():
    with pytest.raises(InvalidRequest) as info:
        plan(request(text(omni_pb2.ROLE_USER, "hi"), text(omni_pb2.ROLE_TOOL, "sunny")))
    assert "messages[1].role: a tool message must follow an assistant message with tool_calls" in str(
        info.value
    )


def _feed(scanner, pieces):
    out = []
    for piece in pieces:
        out += scanner.feed(piece)
    return out + scanner.finish()


def test_calls_are_read_out_of_text_split_anywhere():
    answer = (
        'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "clock", "arguments": "{}"}\n</tool_call>'
    )
    for size in (1, 3, 7, len(answer)):
        pieces = [answer[i : i + size] for i in range(0, len(answer), size)]
        out = _feed(ToolCallScanner(), pieces)
        texts = "".join(x for x in out if isinstance(x, str))
        calls = [(c.name, json.loads(c.arguments_json)) for c in out if not isinstance(c, str)]
        assert texts == "Let me check.\n" and calls == [("weather", {"city": "Paris"}), ("clock", {})]
    out = _feed(ToolCallScanner(), ["a <tool_ca", "ll>not json</tool_call> b <tool_"])
    assert "".join(out) == "a <tool_call>not json</tool_call> b <tool_", "no call: the text as it was"
    (call,) = _feed(ToolCallScanner(), ['<tool_call>{"name": "clock", "arguments": {}}'])
    assert call.name == "clock" and call.id.startswith("call_"), "an unterminated whole block is a call"
    assert _feed(ForcedCallScanner(), ['{"name": "clock", ', '"arguments": {}}'])[0].name == "clock"
    assert _feed(ForcedCallScanner(), ['{"name": "clo']) == ['{"name": "clo'], "cut short: text"


def test_tool_events_keep_token_ids_and_say_tool_calls():
    source = [
        omni_pb2.GenerateEvent(text=omni_pb2.TextDelta(text=t, token_ids=[1, 2]))
        for t in ("Sure", '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>')
    ]
    source.append(omni_pb2.GenerateEvent(finish=omni_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP)))
    planned = plan(request(text(omni_pb2.ROLE_USER, "?")))
    tools = ToolEvents(planned.tools, "r")
    events = [out for event in source for out in tools.of(event)]
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["text", "text", "tool_call", "finish"]
    assert [e.text.text for e in events[:2]] == ["Sure", ""] and all(e.text.token_ids for e in events[:2])
    assert events[2].tool_call.name == "clock"
    assert events[3].finish.reason == common_pb2.FINISH_REASON_TOOL_CALLS


def test_a_raw_prompt_is_one_text_piece_and_nothing_else():
    planned = plan(omni_pb2.GenerateRequest(prompt="<|role_end|>Once upon a time"))
    (piece,) = planned.chat().pieces
    assert piece.text == "<|role_end|>Once upon a time", "client text: its special-token strings stay text"
    for req, needle in (
        (
            omni_pb2.GenerateRequest(prompt="x", messages=[text(omni_pb2.ROLE_USER, "y")]),
            "messages: not with prompt",
        ),
        (omni_pb2.GenerateRequest(prompt="x", system_prompt="s"), "system_prompt: not with prompt"),
        (omni_pb2.GenerateRequest(prompt="x", tools=[CLOCK]), "tools: not with prompt"),
        (
            omni_pb2.GenerateRequest(prompt="x", output_modalities=[omni_pb2.MODALITY_AUDIO]),
            "output_modalities: a raw prompt answers with text only",
        ),
        (omni_pb2.GenerateRequest(prompt="x" * 200_001), "prompt: 200001 characters"),
    ):
        with pytest.raises(InvalidRequest) as info:
            plan(req)
        assert str(info.value).startswith(needle)


def test_a_token_array_prompt_is_one_client_tokens_piece():
    planned = plan(omni_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7]))
    (piece,) = planned.chat().pieces
    assert list(piece.client_tokens.ids) == [5, 6, 7], "a client's ids: the thinker refuses special ones"
    assert planned.least_prompt_tokens == 3
    for req, needle in (
        (omni_pb2.GenerateRequest(prompt="x", prompt_token_ids=[5]), "prompt_token_ids: not with prompt"),
        (omni_pb2.GenerateRequest(prompt_token_ids=[5] * 200_001), "prompt_token_ids: 200001 ids"),
        (
            omni_pb2.GenerateRequest(prompt_token_ids=[5], messages=[text(omni_pb2.ROLE_USER, "y")]),
            "messages: not with prompt",
        ),
    ):
        with pytest.raises(InvalidRequest) as info:
            plan(req)
        assert str(info.value).startswith(needle)


def test_a_block_left_open_comes_as_one_text_right_before_the_finish():
    """The OpenAI front reads a call max_tokens cut from this last text (answers.cut_answer)."""
    source = [
        omni_pb2.GenerateEvent(text=omni_pb2.TextDelta(text=t, token_ids=[1]))
        for t in ("Sure <tool", '_call>\n{"name": ', '"weather", "argu')
    ]
    source.append(omni_pb2.GenerateEvent(finish=omni_pb2.Finish(reason=common_pb2.FINISH_REASON_LENGTH)))
    tools = ToolEvents(plan(request(text(omni_pb2.ROLE_USER, "?"))).tools, "r")
    events = [out for event in source for out in tools.of(event)]
    shown = [e.text.text for e in events if e.WhichOneof("event") == "text"]
    assert [s for s in shown if s] == ["Sure ", '<tool_call>\n{"name": "weather", "argu']
    assert events[-2].text.text == shown[-1] and events[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH
