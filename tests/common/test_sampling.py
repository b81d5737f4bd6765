"""The one rule table for sampling: every field's refusal names it; the engine applies the same rules."""

from __future__ import annotations

import json
import math
import re

import pytest
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.sampling import check_sampling
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.v1 import common_pb2

BAD = [
    (dict(temperature=-1.0), "sampling.temperature"),
    (dict(temperature=1e-40), "sampling.temperature"),  # subnormal: logits / T would be NaN
    (dict(temperature=0.001), "sampling.temperature"),
    (dict(temperature=1000.0), "sampling.temperature"),
    (dict(temperature=math.nan), "sampling.temperature"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(top_p=-0.1), "sampling.top_p"),
    (dict(top_k=-1), "sampling.top_k"),
    (dict(min_p=math.inf), "sampling.min_p"),
    (dict(repetition_penalty=-1.0), "sampling.repetition_penalty"),
    (dict(repetition_penalty=1e-30), "sampling.repetition_penalty"),
    (dict(presence_penalty=3.0), "sampling.presence_penalty"),
    (dict(presence_penalty=math.nan), "sampling.presence_penalty"),
    (dict(logprobs=21), "sampling.logprobs"),
    (dict(stop=["x"] * 17), "sampling.stop"),
    (dict(stop=["ok", ""]), "sampling.stop[1]"),
    (dict(stop=["y" * 257]), "sampling.stop[0]"),
    (dict(stop_token_ids=[3, -1]), "sampling.stop_token_ids[1]"),
]


@pytest.mark.parametrize("fields, needle", BAD, ids=[f"{n}={list(f.values())[0]!r}"[:40] for f, n in BAD])
def test_each_rule_names_its_field(fields, needle):
    with pytest.raises(InvalidRequest, match=f"^{re.escape(needle)}: "):
        check_sampling(common_pb2.SamplingParams(**fields))


@pytest.mark.parametrize("fields, needle", [b for b in BAD if "stop" not in b[1] or "[" in b[1]])
def test_the_engine_applies_the_same_rules(fields, needle):
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    with pytest.raises(ValueError, match=f"^{re.escape(needle)}: "):
        SamplingParams(**values)


def test_good_values_pass_and_proto_zero_means_off_in_the_engine():
    s = common_pb2.SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.05,
        presence_penalty=-0.5,
        max_tokens=100,
        stop=["\n\n"],
        logprobs=5,
    )
    check_sampling(s, max_model_len=1024, vocab_size=1000)
    check_sampling(common_pb2.SamplingParams())
    check_sampling(common_pb2.SamplingParams(temperature=0.01))
    check_sampling(common_pb2.SamplingParams(temperature=100.0))
    p = SamplingParams(top_p=0.0, repetition_penalty=0.0)
    assert p.top_p == 1.0 and p.repetition_penalty == 1.0


@pytest.mark.parametrize("max_tokens", [5000, 2**32 - 1])
def test_max_tokens_above_max_model_len_is_refused_naming_the_limit(max_tokens):
    with pytest.raises(InvalidRequest) as err:
        check_sampling(common_pb2.SamplingParams(max_tokens=max_tokens), max_model_len=1024)
    assert str(err.value) == f"sampling.max_tokens: {max_tokens} exceeds max_model_len 1024"
    check_sampling(common_pb2.SamplingParams(max_tokens=max_tokens))  # limit unknown: no bound here


def test_stop_token_ids_are_bounded_by_the_vocabulary():
    with pytest.raises(
        InvalidRequest, match=r"sampling.stop_token_ids\[0\]: must be a token id \(0..99\), got 100"
    ):
        check_sampling(common_pb2.SamplingParams(stop_token_ids=[100]), vocab_size=100)


@pytest.mark.parametrize(
    ("set_it", "needle"),
    [
        (lambda s: s.constraint.SetInParent(), "sampling.constraint: set json_object, json_schema or ebnf"),
        (
            lambda s: setattr(s.constraint, "json_object", False),
            "sampling.constraint.json_object: must be true",
        ),
        (lambda s: setattr(s.constraint, "ebnf", "x" * 65537), "sampling.constraint.ebnf: must be 1..65536"),
        (
            lambda s: (setattr(s.constraint, "json_schema", "{}"), setattr(s, "ignore_eos", True)),
            "sampling.constraint.json_schema: not with sampling.ignore_eos",
        ),
    ],
    ids=["no-kind", "json-object-false", "too-long", "ignore-eos"],
)
def test_constraint_shape_rules_name_the_field(set_it, needle):
    from omnistage.common.runtime.errors import InvalidRequest
    from omnistage.common.sampling import check_sampling
    from omnistage.v1 import common_pb2

    s = common_pb2.SamplingParams()
    set_it(s)
    with pytest.raises(InvalidRequest) as info:
        check_sampling(s)
    assert str(info.value).startswith(needle)
    ok = common_pb2.SamplingParams()
    ok.constraint.json_schema = '{"type": "object"}'
    check_sampling(ok)


def _nested(depth: int) -> str:
    schema: dict = {"type": "string", "description": 'brackets in a string do not count: {[{[ \\" {'}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


def test_a_json_schema_nested_past_the_depth_bound_is_refused_before_any_compile():
    """Compile time grows much faster than the nesting (issue 43: 450 levels, a minute on a tiny
    vocabulary, within the size bound): 31 levels of objects (63 brackets) pass, 32 do not."""
    from omnistage.common.sampling import MAX_GRAMMAR_DEPTH, json_depth

    assert json_depth(_nested(31)) == 63 <= MAX_GRAMMAR_DEPTH < json_depth(_nested(32)) == 65
    ok = common_pb2.SamplingParams()
    ok.constraint.json_schema = _nested(31)
    check_sampling(ok)
    deep = common_pb2.SamplingParams()
    deep.constraint.json_schema = _nested(450)
    with pytest.raises(InvalidRequest) as info:
        check_sampling(deep)
    assert str(info.value).startswith(
        f"sampling.constraint.json_schema: objects and arrays nested 901 deep, at most {MAX_GRAMMAR_DEPTH}"
    )
    ebnf = common_pb2.SamplingParams()
    ebnf.constraint.ebnf = 'root ::= "[[[[" root | "x"'  # EBNF text has no JSON nesting to count
    check_sampling(ebnf)
