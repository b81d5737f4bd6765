"""LLMEngine end to end on the fake model (fast): batching, chunking and preemption never change tokens."""

from __future__ import annotations

import random

import pytest
import torch
from omnistage.services.thinker.engine.budget import RequestBudget, RequestError
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams
from omnistage.services.thinker.models.layers.attention import AttentionMetadata, attention_metadata

from tests.services.thinker.engine.engine_fakes import FakeModel, make_fake_engine


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 128) for _ in range(rng.randrange(3, 90))] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(max_num_batched_tokens=64, chunked_prefill=True),
        dict(max_num_batched_tokens=256, chunked_prefill=False),
        dict(max_num_batched_tokens=64, num_kv_blocks=24),  # forces preemption
    ],
    ids=["chunked", "unchunked", "preempting"],
)
def test_tokens_identical_alone_or_among_31_others(engine_kw):
    ps = prompts(32)
    alone = make_fake_engine(block_size=8, max_model_len=256, max_num_batched_tokens=256)
    ref = [alone.generate([p], GREEDY)[0].token_ids for p in ps[:3]]
    engine = make_fake_engine(block_size=8, max_model_len=256, **engine_kw)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=24, ignore_eos=True)
    params = [GREEDY] * 32
    params[5] = seeded
    results = engine.generate(ps, params)
    assert [r.token_ids for r in results[:3]] == ref
    assert all(len(r.token_ids) == 24 and r.finish_reason is FinishReason.LENGTH for r in results)
    assert results[5].token_ids == alone.generate([ps[5]], seeded)[0].token_ids
    if engine_kw.get("num_kv_blocks"):
        assert engine.scheduler.block_manager.num_free_blocks == 24


def test_preemption_actually_happens_with_a_small_cache():
    engine = make_fake_engine(block_size=8, max_model_len=256, max_num_batched_tokens=64, num_kv_blocks=24)
    preempted = []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))
    engine.generate(prompts(32), GREEDY)
    assert preempted


def test_paged_decode_equals_full_reforward():
    engine = make_fake_engine(block_size=4, max_model_len=128, max_num_batched_tokens=16)
    p = prompts(1, seed=3)[0]
    out = engine.generate([p], GREEDY)[0].token_ids
    model: FakeModel = engine.runner.model
    full = torch.tensor(p + out)
    pos = torch.arange(len(full)).expand(3, -1)
    saved = model.attn.k_cache, model.attn.v_cache
    model.attn.k_cache = model.attn.v_cache = torch.empty(0)
    with torch.no_grad(), attention_metadata(AttentionMetadata.no_cache([len(full)])):
        logits = model.compute_logits(model(full, pos))
    model.attn.k_cache, model.attn.v_cache = saved
    assert logits[len(p) - 1 : -1].argmax(-1).tolist() == out


def test_stop_string_ends_the_request_and_is_not_returned():
    engine = make_fake_engine(block_size=8, max_model_len=256)
    p = prompts(1, seed=4)[0]
    free = engine.generate([p], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    text = free.text
    assert len(text) > 12
    stop = text[8:11]
    first = text.find(stop)
    res = engine.generate([p], SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)))[0]
    assert res.finish_reason is FinishReason.STOP_STRING
    assert res.text == text[:first]
    assert engine.scheduler.block_manager.num_free_blocks == engine.cfg.num_kv_blocks


def test_eos_ends_with_stop_and_its_text_is_not_shown():
    engine = make_fake_engine(block_size=8, max_model_len=256)
    p = prompts(1, seed=5)[0]
    free = engine.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    # make the 6th generated token an end-of-sequence id for this request
    res = engine.generate([p], SamplingParams(max_tokens=20, stop_token_ids=(free.token_ids[5],)))[0]
    assert res.finish_reason is FinishReason.STOP
    assert res.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[5]) + 1]


def test_streaming_outputs_usage_logprobs_and_abort():
    engine = make_fake_engine(block_size=8, max_model_len=256, max_num_batched_tokens=32)
    engine.add_prompt("a", prompts(1)[0], SamplingParams(max_tokens=5, logprobs=2, ignore_eos=True))
    engine.add_prompt("b", prompts(1, seed=1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    outs = []
    while engine.has_unfinished() and not any(o.finished for o in outs):
        outs += engine.step()
    a_outs = [o for o in outs if o.request_id == "a"]
    assert [len(o.token_ids) for o in a_outs] == [1] * 5
    assert all(len(o.logprobs) == 1 and len(o.logprobs[0].top_token_ids) == 2 for o in a_outs)
    last = a_outs[-1]
    assert last.finished and last.finish_reason is FinishReason.LENGTH
    assert last.usage.completion_tokens == 5 and last.usage.prompt_tokens == len(prompts(1)[0])
    assert engine.abort("b") and not engine.abort("b")
    assert not engine.has_unfinished()
    assert engine.scheduler.block_manager.num_free_blocks == engine.cfg.num_kv_blocks


def test_a_request_made_here_gets_its_budget_and_the_engine_asserts_it():
    """The budget is computed where the request is made (`add_prompt` for requests made on the
    engine; the flow for clients'); `add_request` only asserts it (admission is the flow's)."""
    engine = make_fake_engine(block_size=8, max_model_len=64)
    with pytest.raises(RequestError, match="empty"):
        engine.add_prompt("e", [], SamplingParams())
    with pytest.raises(
        RequestError, match=r"^prompt: 64 token\(s\) leave no room to generate \(max_model_len 64\)$"
    ):
        engine.add_prompt("long", list(range(64)), SamplingParams())
    engine.add_prompt("x", [1, 2], SamplingParams())
    assert engine.scheduler.seqs["x"].max_tokens == 62  # 0: the default (256), clamped to the context
    with pytest.raises(AssertionError, match="already running"):
        engine.add_prompt("x", [1], SamplingParams())
    too_long = RequestBudget(3, 62, 64)  # a budget that does not hold: a defect of its maker
    with pytest.raises(AssertionError):
        engine.add_request("w", [1, 2, 3], SamplingParams(), too_long)
    assert set(engine.scheduler.seqs) == {"x"}


def test_max_tokens_that_cannot_fit_is_refused_with_both_numbers():
    engine = make_fake_engine(block_size=8, max_model_len=64)
    with pytest.raises(RequestError, match=r"^sampling.max_tokens: 1000 exceeds max_model_len 64$"):
        engine.add_prompt("a", [1, 2], SamplingParams(max_tokens=1000))
    with pytest.raises(
        RequestError, match=r"^sampling.max_tokens: 63 \+ a prompt of 2 token\(s\) exceeds max_model_len 64$"
    ):
        engine.add_prompt("b", [1, 2], SamplingParams(max_tokens=63))
    engine.add_prompt("c", [1, 2], SamplingParams(max_tokens=62))
    assert engine.scheduler.seqs["c"].max_tokens == 62
    assert list(engine.scheduler.seqs) == ["c"]


def test_stop_string_on_the_last_allowed_token_reports_stop_string():
    engine = make_fake_engine(block_size=8, max_model_len=256)
    p = prompts(1, seed=4)[0]
    text = engine.generate([p], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    stop = text[8:11]
    first = engine.generate([p], SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)))[0]
    assert first.finish_reason is FinishReason.STOP_STRING
    # The same request with max_tokens ending exactly on the token that completes the stop string.
    last = engine.generate(
        [p], SamplingParams(max_tokens=len(first.token_ids), ignore_eos=True, stop=(stop,))
    )[0]
    assert last.token_ids == first.token_ids
    assert last.finish_reason is FinishReason.STOP_STRING
    assert last.text == first.text


def test_abort_returns_the_requests_final_output():
    engine = make_fake_engine(block_size=8, max_model_len=256)
    engine.add_prompt("a", prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort("a")
    assert out.request_id == "a" and out.finished and out.finish_reason is FinishReason.ABORT
    assert out.token_ids == [] and out.usage.completion_tokens == 2
    assert out.usage.prompt_tokens == len(prompts(1)[0])
    assert engine.abort("a") is None and engine.abort("never-added") is None
