"""Async scheduling (`engine.async_scheduling: on`) on the fake model: the next step is launched before
the previous step's ids reach the host (its decodes' inputs are placeholders filled on the device),
and every output is what the synchronous engine gives — tokens, text, logprobs, ends by max_tokens,
EOS, stop ids and stop strings, arrivals mid-run, preemption, prefix caching; a request that ended
(or was aborted) while a step ran gets nothing from it; every KV block comes back."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.common.config.checks import ConfigError
from omnistage.services.thinker.engine.config import async_scheduling_on, resolve_engine_config
from omnistage.services.thinker.engine.llm_engine import LLMEngine, RequestOutput
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams

from tests.services.thinker.engine.engine_fakes import EOS, ByteTokenizer, FakeModel

BASE = dict(block_size=8, max_model_len=256)


def make(async_on: bool, eos: tuple[int, ...] = (EOS,), **kw) -> LLMEngine:
    cfg = resolve_engine_config(EngineConfig(**BASE, async_scheduling="on" if async_on else "off", **kw))
    return LLMEngine(ModelRunner(FakeModel(), cfg, "cpu"), ByteTokenizer(), list(eos))


def prompts(n: int, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(32, 128) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


@dataclass
class Stream:
    """One request's outputs as a client sees them."""

    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def last(self) -> RequestOutput:
        return self.outputs[-1]

    def summary(self) -> tuple:
        logprobs = [
            (lp.token_id, round(lp.logprob, 5), lp.top_token_ids) for o in self.outputs for lp in o.logprobs
        ]
        last = self.last
        return self.token_ids, self.text, last.finish_reason, last.usage.completion_tokens, logprobs


Arrival = tuple[int, str, list[int], SamplingParams]  # (step() call, request id, prompt, params)


def drive(engine: LLMEngine, arrivals: list[Arrival], aborts: dict[int, list[str]] | None = None) -> dict:
    """Step `engine` until done, adding each request before its step() call and aborting as told;
    every stream must end with exactly one final output."""
    streams: dict[str, Stream] = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    call = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= call:
            _, rid, prompt, params = pending.pop(0)
            engine.add_prompt(rid, prompt, params)
            streams[rid] = Stream()
        for rid in (aborts or {}).get(call, []):
            out = engine.abort(rid)
            if out is not None:
                streams[rid].outputs.append(out)
        for out in engine.step():
            stream = streams[out.request_id]
            assert not (stream.outputs and stream.last.finished), f"{out.request_id}: output after its end"
            stream.outputs.append(out)
        call += 1
        assert call < 2000, "the engine never finished"
    assert all(s.last.finished for s in streams.values())
    assert engine.scheduler.block_manager.num_free_blocks == engine.cfg.num_kv_blocks
    return streams


def mixed_arrivals(reference: dict[str, Stream], base: list[Arrival], stop_token: int) -> list[Arrival]:
    """The same requests with ends of every kind, chosen from what they generate freely."""
    out = []
    for i, (call, rid, prompt, _) in enumerate(base):
        free = reference[rid]
        kind = i % 5
        if kind == 1:  # a stop id it meets on the way
            params = SamplingParams(max_tokens=24, stop_token_ids=(free.token_ids[4],))
        elif kind == 2:  # a stop string of its own text
            params = SamplingParams(max_tokens=24, ignore_eos=True, stop=(free.text[6:9],))
        elif kind == 3:  # the engine's EOS (a token several requests generate)
            params = SamplingParams(max_tokens=24)
        elif kind == 4:  # seeded draws with logprobs
            params = SamplingParams(
                temperature=0.8, top_k=20, seed=i, max_tokens=17, logprobs=3, ignore_eos=True
            )
        else:  # max_tokens
            params = SamplingParams(max_tokens=5 + i % 7, ignore_eos=True, logprobs=1)
        out.append((call, rid, prompt, params))
    return out


def common_token(streams: dict[str, Stream]) -> int:
    """A token that several free runs generate after their first few (made the EOS of the test)."""
    counts: dict[int, int] = {}
    for s in streams.values():
        for t in set(s.token_ids[3:]):
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=lambda t: counts[t])


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_num_batched_tokens=64),
        dict(max_num_batched_tokens=256, chunked_prefill=False),
        dict(max_num_batched_tokens=64, num_kv_blocks=24),
        dict(max_num_batched_tokens=64, prefill_tokens_while_decoding=16),
    ],
    ids=["chunked", "unchunked", "preempting", "capped-while-decoding"],
)
def test_every_output_equals_the_synchronous_engines(kw):
    ps = prompts(20)
    base = [(i // 3, f"r{i}", p, SamplingParams(max_tokens=24, ignore_eos=True)) for i, p in enumerate(ps)]
    free = drive(make(False, **kw), base)
    eos = common_token(free)
    arrivals = mixed_arrivals(free, base, eos)
    want = drive(make(False, eos=(EOS, eos), **kw), arrivals)
    got = drive(make(True, eos=(EOS, eos), **kw), arrivals)
    assert {rid: s.summary() for rid, s in got.items()} == {rid: s.summary() for rid, s in want.items()}
    reasons = {s.last.finish_reason for s in got.values()}
    assert {FinishReason.LENGTH, FinishReason.STOP, FinishReason.STOP_STRING} <= reasons


def test_the_next_step_is_launched_before_the_previous_ids_reach_the_host():
    """On today's synchronous engine each forward follows the previous step's postprocess; here the
    decode's forward is queued first, its input a placeholder the runner fills on the device."""
    for async_on in (False, True):
        engine = make(async_on)
        events: list[str] = []
        execute, postprocess = engine.runner.execute_step, engine.scheduler.postprocess

        def forward(plan, execute=execute, events=events):
            events.append("forward*" if plan.has_placeholders else "forward")
            return execute(plan)

        def ids(batch, token_ids, postprocess=postprocess, events=events):
            events.extend(["ids"] if batch.scheduled else [])
            return postprocess(batch, token_ids)

        engine.runner.execute_step, engine.scheduler.postprocess = forward, ids
        (result,) = engine.generate([prompts(1)[0]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(result.token_ids) == 4
        if async_on:  # 4 forwards: the prompt, then three decodes each queued before the ids before it
            assert events == ["forward", "forward*", "ids", "forward*", "ids", "forward*", "ids", "ids"]
        else:
            assert events == ["forward", "ids"] * 4


def test_a_step_is_never_launched_for_a_token_known_to_be_the_last():
    """max_tokens is known ahead: no step is spent on a request that ends whatever it samples; a stop
    id is only known once seen, and costs one slot whose token nobody gets."""
    forwards = {}
    for async_on in (False, True):
        engine = make(async_on)
        count = [0]

        def forward(plan, execute=engine.runner.execute_step, count=count):
            count[0] += 1
            return execute(plan)

        engine.runner.execute_step = forward
        p = prompts(1, seed=3)[0]
        free = engine.generate([p], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        stopped = engine.generate([p], SamplingParams(max_tokens=20, stop_token_ids=(free.token_ids[2],)))[0]
        assert stopped.finish_reason is FinishReason.STOP
        forwards[async_on] = count[0]
        assert engine.scheduler.block_manager.num_free_blocks == engine.cfg.num_kv_blocks
    assert forwards == {False: 6 + 3, True: 6 + 3 + 1}


def test_an_abort_while_a_step_runs_gets_nothing_from_that_step():
    engine, ref = make(True), make(False)
    p = prompts(1, seed=6)[0]
    want = ref.generate([p], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    streams = drive(
        engine,
        [
            (0, "a", p, SamplingParams(max_tokens=30, ignore_eos=True)),
            (0, "b", p, SamplingParams(max_tokens=8, ignore_eos=True)),
        ],
        aborts={3: ["a"]},
    )
    a = streams["a"]
    assert a.last.finish_reason is FinishReason.ABORT and a.last.token_ids == []
    assert a.token_ids == want[: len(a.token_ids)] and 0 < len(a.token_ids) < 4
    assert a.last.usage.completion_tokens == len(a.token_ids)  # the token in flight at the abort is dropped
    assert streams["b"].token_ids == want[:8]


def test_a_request_that_needs_its_tokens_on_the_host_completes_each_step_at_once():
    """Repetition and presence penalties read the tokens on the host: a step that samples one is not
    left running while the next is planned, and its tokens are the synchronous engine's."""
    ps = prompts(3, seed=8)
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=0.5),
        SamplingParams(max_tokens=12, ignore_eos=True),
    ]
    want = [r.token_ids for r in make(False).generate(ps, params)]
    engine = make(True)
    left_running = []
    step = engine.step

    def watched():
        out = step()
        flight = engine.in_flight
        if flight is not None:
            left_running.extend(s.params for s in flight.batch.sampling_seqs)
        return out

    engine.step = watched
    assert [r.token_ids for r in engine.generate(ps, params)] == want
    assert params[0] not in left_running and params[1] not in left_running
    alone = make(True)
    alone.step = lambda: (alone.__class__.step(alone), left_running.append(alone.in_flight is not None))[0]
    left_running.clear()
    alone.generate([ps[2]], params[2])
    assert any(left_running)  # a free request alone does run ahead


def test_prefix_caching_gives_the_same_tokens_and_hits():
    shared = prompts(1, seed=11)[0][:40] + list(range(40, 72))  # 72 tokens: 9 full blocks
    ps = prompts(6, seed=12, prefix=shared)
    arrivals = [
        (3 * (i // 2), f"p{i}", p, SamplingParams(max_tokens=10, ignore_eos=True)) for i, p in enumerate(ps)
    ]
    want = drive(make(False, max_num_batched_tokens=64), arrivals)
    got = drive(make(True, max_num_batched_tokens=64), arrivals)
    assert {r: s.token_ids for r, s in got.items()} == {r: s.token_ids for r, s in want.items()}
    later = [got[f"p{i}"].last.usage.cached_prompt_tokens for i in range(2, 6)]
    assert all(n >= 5 * 8 for n in later), later  # the shared prefix's blocks came from the cache


def test_the_knob_is_auto_on_off_and_auto_means_cuda():
    assert not async_scheduling_on("auto", torch.device("cpu"))
    assert async_scheduling_on("auto", torch.device("cuda", 0))
    assert async_scheduling_on("on", torch.device("cpu")) and not async_scheduling_on(
        "off", torch.device("cuda")
    )
    assert EngineConfig().async_scheduling == "auto"
    with pytest.raises(ConfigError, match="engine.async_scheduling: expected auto, on or off"):
        EngineConfig(async_scheduling="yes").validate("engine")


def test_a_plan_keeps_its_placeholders_and_share_flag_on_the_wire():
    from omnistage.services.thinker.engine.step_plan import build_step_plan
    from omnistage.services.thinker.tp.plan import StepPlan

    engine = make(True)
    engine.add_prompt("a", prompts(1)[0], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt's step runs ahead: a placeholder for its token
    plan = build_step_plan(engine.scheduler.schedule().scheduled, engine.cfg.block_size)
    plan.share_sampled = True
    back = StepPlan.decode(plan.encode())
    assert back.input_ids.tolist() == [-1] and back.has_placeholders and back.share_sampled
    assert not StepPlan.decode(StepPlan().encode()).share_sampled
