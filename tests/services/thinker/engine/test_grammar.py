"""Grammar-constrained sampling: the engine (a random one-layer model, the tiny checkpoint's tokenizer)
steered into valid output — 20 random JSON schemas validated with `jsonschema`, JSON objects, EBNF —
alongside unconstrained requests in the same batch; schemas that do not compile named precisely; the
masks filled on their own thread while the forward runs; a grammar that cannot go on ends its
request with an error, the others go on."""

from __future__ import annotations

import json
import random
import threading

import jsonschema
import pytest
import torch
import xgrammar
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.grammar import GrammarError, Grammars, GrammarSpec
from omnistage.services.thinker.engine.grammar_masks import GrammarMasks
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams
from omnistage.services.thinker.models.tokenizer import MingTokenizer

from tests.services.thinker.engine.engine_fakes import FakeModel


@pytest.fixture(scope="module")
def tok(tiny_ckpt) -> MingTokenizer:
    return MingTokenizer(tiny_ckpt)


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok)


def engine(tok: MingTokenizer, padded: int = 0, async_scheduling: str = "off") -> LLMEngine:
    """The real engine over a random one-layer model whose head is `padded` columns wider than the
    tokenizer's vocabulary (as a padded embedding is)."""
    cfg = resolve_engine_config(
        EngineConfig(
            block_size=8,
            max_model_len=512,
            max_num_seqs=32,
            max_num_batched_tokens=1024,
            async_scheduling=async_scheduling,
        )
    )
    model = FakeModel(vocab=tok.vocab_size + padded, hidden=32)
    return LLMEngine(ModelRunner(model, cfg, "cpu"), tok, list(tok.stop_token_ids))


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object of bounded leaves (integers, numbers, enums, booleans, short strings) and arrays of
    them, nested up to two levels: every random walk through it ends."""
    leaves = [
        lambda: {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 500)},
        lambda: {"type": "number", "minimum": -1, "maximum": rng.choice([1, 10, 1000])},
        lambda: {"enum": rng.sample(["red", "green", "blue", "cyan", 3, None, True], rng.randint(1, 4))},
        lambda: {"type": "boolean"},
        # (Bounded by a pattern: xgrammar 0.2.8 lets a maxLength string hold raw control characters.)
        lambda: {"type": "string", "pattern": f"^[a-z ]{{0,{rng.randint(1, 8)}}}$"},
    ]
    props = {}
    for i in range(rng.randint(1, 4)):
        pick = rng.random()
        if pick < 0.2 and depth < 2:
            props[f"p{i}"] = random_schema(rng, depth + 1)
        elif pick < 0.4:
            props[f"p{i}"] = {"type": "array", "items": rng.choice(leaves)(), "maxItems": rng.randint(1, 4)}
        else:
            props[f"p{i}"] = rng.choice(leaves)()
    required = sorted(rng.sample(sorted(props), rng.randint(0, len(props))))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def constrained(grammars: Grammars, kind: str, text: str = "", **kw) -> SamplingParams:
    return SamplingParams(grammar=grammars.compile(GrammarSpec(kind, text)), **kw)


def test_twenty_random_schemas_give_valid_json_amid_free_requests(tok, grammars):
    rng = random.Random(33)
    schemas = [random_schema(rng) for _ in range(20)]
    params = [
        constrained(grammars, "json_schema", json.dumps(s), temperature=1.0, seed=i, max_tokens=400)
        for i, s in enumerate(schemas)
    ]
    free = SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True)
    prompts = [tok.encode(f"Give me JSON number {i}.") for i in range(21)]
    results = engine(tok, padded=24).generate(prompts, [*params, free])
    for schema, result in zip(schemas, results[:20], strict=True):
        assert result.finish_reason is FinishReason.STOP, (result.text, schema)
        jsonschema.validate(json.loads(result.text), schema)
    assert results[20].finish_reason is FinishReason.LENGTH and len(results[20].token_ids) == 20
    assert len({r.text for r in results[:20]}) > 15, "sampled, not one fixed answer"


def test_json_object_and_ebnf_steer_greedy_and_random_draws(tok, grammars):
    yes_no = 'root ::= "yes" | "no" | "maybe so"'
    params = [
        constrained(grammars, "json_object", max_tokens=300, temperature=1.0, seed=5),
        constrained(grammars, "ebnf", yes_no, max_tokens=20),
        constrained(grammars, "ebnf", yes_no, max_tokens=20, temperature=1.0, seed=1),
    ]
    results = engine(tok).generate([tok.encode("Answer:")] * 3, params)
    assert results[0].finish_reason is FinishReason.STOP and isinstance(json.loads(results[0].text), dict)
    for result in results[1:]:
        assert result.finish_reason is FinishReason.STOP and result.text in ("yes", "no", "maybe so")


def test_async_scheduling_gives_constrained_and_free_requests_their_synchronous_outputs(tok, grammars):
    """A step that samples a constrained request completes before the next is planned (its mask is
    filled from the grammar's state, which needs the ids on the host); the others run ahead when
    alone. Every request's output is the synchronous engine's."""
    yes_no = 'root ::= "yes" | "no" | "maybe so"'
    params = [
        constrained(grammars, "json_object", max_tokens=20, temperature=1.0, seed=5),
        SamplingParams(temperature=1.0, seed=9, max_tokens=40, ignore_eos=True),
        constrained(grammars, "ebnf", yes_no, max_tokens=20),
        SamplingParams(max_tokens=30, ignore_eos=True),
    ]
    prompts = [tok.encode(f"Answer {i}:") for i in range(4)]
    want = engine(tok).generate(prompts, params)
    eng = engine(tok, async_scheduling="on")
    ahead_with_grammar = []
    step = eng.step

    def watched():
        out = step()
        if eng.in_flight is not None:
            ahead_with_grammar.append(any(q.matcher for q in eng.in_flight.batch.sampling_seqs))
        return out

    eng.step = watched
    got = eng.generate(prompts, params)
    assert [(r.token_ids, r.text, r.finish_reason) for r in got] == [
        (r.token_ids, r.text, r.finish_reason) for r in want
    ]
    assert got[2].text in ("yes", "no", "maybe so")
    assert ahead_with_grammar  # once the constrained requests ended, the free one ran ahead
    assert not any(ahead_with_grammar), "a step with a constrained row was left running"


def test_a_schema_cut_by_max_tokens_ends_with_length(tok, grammars):
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    params = constrained(grammars, "json_schema", json.dumps(schema), max_tokens=10, temperature=1.0, seed=2)
    (result,) = engine(tok).generate([tok.encode("x")], params)
    assert result.finish_reason is FinishReason.LENGTH and result.text.startswith('{"s": "')


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (GrammarSpec("json_schema", '{"type": "nope"}'), 'Unsupported type "nope"'),
        (GrammarSpec("json_schema", '{"type": '), "Failed to parse JSON"),
        (GrammarSpec("ebnf", "root ::= b"), 'Rule "b" is not defined'),
    ],
)
def test_a_grammar_that_does_not_compile_is_named_with_the_compilers_message(grammars, spec, needle):
    with pytest.raises(GrammarError) as info:
        grammars.compile(spec)
    message = str(info.value)
    assert message.startswith(f"sampling.constraint.{spec.kind}: does not compile: ") and needle in message
    assert ".cc:" not in message, "the C++ source place is left out"


def test_the_same_schema_compiles_once(grammars):
    text = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}})
    compiler = grammars.compiler()
    grammars.compile(GrammarSpec("json_schema", text))
    size = compiler.get_cache_size_bytes()
    grammars.compile(GrammarSpec("json_schema", text))
    assert size > 0 and compiler.get_cache_size_bytes() == size


def test_the_masks_are_filled_on_their_own_thread_while_the_forward_runs(tok, grammars, monkeypatch):
    """The per-step grammar work does not add to every stream's step: each step's fill has run, on
    the mask thread, by the time the forward starts (it waits for it here, at most 10 s)."""
    filled, threads = threading.Event(), set()
    for cls, name in (
        (xgrammar.GrammarMatcher, "fill_next_token_bitmask"),
        (xgrammar.BatchGrammarMatcher, "batch_fill_next_token_bitmask"),
    ):

        def fill(self, *args, _original=getattr(cls, name), **kw):
            _original(self, *args, **kw)
            threads.add(threading.current_thread().name)
            filled.set()

        monkeypatch.setattr(cls, name, fill)
    eng = engine(tok)
    forward, during = eng.runner.execute_step, []

    def execute_step(plan):
        during.append(filled.wait(timeout=10))
        filled.clear()
        return forward(plan)

    eng.runner.execute_step = execute_step
    params = constrained(grammars, "ebnf", 'root ::= "yes" | "no"', max_tokens=5)
    (result,) = eng.generate([tok.encode("Answer:")], params)
    assert result.text in ("yes", "no") and len(during) >= 2
    assert all(during), f"fill done before each forward: {during}"
    assert threads == {"grammar-mask_0"}


def test_a_grammar_that_has_ended_ends_its_request_with_an_error_and_the_others_go_on(tok, grammars):
    """ignore_eos past the grammar's end (the proto refuses it; the engine's own callers need not):
    its next token cannot be masked. Once the whole engine failed here; now that request ends."""
    done = constrained(grammars, "ebnf", 'root ::= "yes"', max_tokens=8, ignore_eos=True)
    free = SamplingParams(max_tokens=8, ignore_eos=True)
    ended, other = engine(tok).generate([tok.encode("Say yes:")] * 2, [done, free])
    assert ended.finish_reason is FinishReason.ERROR and ended.text.startswith("yes")
    assert ended.message.startswith("sampling.constraint: the grammar had already ended")
    assert other.finish_reason is FinishReason.LENGTH and len(other.token_ids) == 8


def test_a_token_the_grammar_refuses_ends_its_request_naming_it(tok, grammars):
    """The mask lets only accepted tokens through; should one be refused all the same (a mask and a
    matcher that disagree), the request ends saying so instead of going on outside its grammar."""

    class Seq:
        def __init__(self, grammar) -> None:
            self.matcher = grammar.matcher() if grammar is not None else None

    yes_no = grammars.compile(GrammarSpec("ebnf", 'root ::= "yes" | "no"'))
    masks = GrammarMasks()
    try:
        pending = masks.begin([Seq(None), Seq(yes_no), Seq(yes_no)])
        pending.apply(torch.zeros(3, tok.vocab_size))
        allowed = tok.encode("yes")[0]
        refused = tok.encode("{")[0]
        assert pending.accept([refused, refused, allowed]) == {
            1: f"sampling.constraint: the grammar refused the sampled token {refused}"
        }
        assert masks.begin([Seq(None)]) is None
    finally:
        masks.close()
