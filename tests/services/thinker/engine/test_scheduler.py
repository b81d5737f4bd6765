from __future__ import annotations

import pytest
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.scheduler import Scheduler
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

EOS = 0


def make(**kw) -> Scheduler:
    return Scheduler(resolve_engine_config(EngineConfig(**kw)), [EOS])


def seq(rid: str, n: int, max_tokens: int = 4, **params) -> Sequence:
    """A prompt of its own: no two requests share a prefix (prefix caching stays out of these tests)."""
    base = 1 + 1000 * sum(map(ord, rid))
    return Sequence(rid, list(range(base, base + n)), SamplingParams(**params), max_tokens)


def step(s: Scheduler, token: int = 7):
    batch = s.schedule()
    sched = [(q.request_id, n) for q, n in batch.scheduled]
    s.advance(batch)
    s.postprocess(batch, [token] * len(batch.sampling_seqs))
    return sched, batch


def test_chunked_prefill_splits_a_long_prompt_and_decodes_share_the_step():
    s = make(block_size=4, max_num_batched_tokens=8, max_model_len=64)
    s.add(seq("short", 3))
    assert step(s)[0] == [("short", 3)]
    s.add(seq("long", 20))
    sched, _ = step(s)
    assert sched == [("short", 1), ("long", 7)]  # the decode first, then a chunk filling the budget
    sched, batch = step(s)
    assert sched == [("short", 1), ("long", 7)]
    sched, batch = step(s)
    assert sched == [("short", 1), ("long", 6)]
    assert [q.request_id for q in batch.sampling_seqs] == ["short", "long"]  # long's prompt completed


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make(block_size=4, max_num_batched_tokens=32, max_model_len=32, chunked_prefill=False)
    s.add(seq("a", 10))
    s.add(seq("b", 25, max_tokens=2))
    assert step(s)[0] == [("a", 10)]  # b needs 25 tokens, 22 are left: it waits instead of a chunk
    assert step(s)[0] == [("a", 1), ("b", 25)]


def test_budgets_bound_sequences_and_tokens():
    s = make(block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    for i in range(4):
        s.add(seq(f"r{i}", 5))
    sched, _ = step(s)
    assert sched == [("r0", 5), ("r1", 5)]
    sched, _ = step(s)
    assert sched == [("r0", 1), ("r1", 1)]


def test_preemption_when_blocks_run_out_then_recompute_and_no_leak():
    s = make(block_size=4, num_kv_blocks=4, max_num_batched_tokens=64, max_model_len=16)
    a, b = seq("a", 7, max_tokens=9), seq("b", 7, max_tokens=9)
    s.add(a)
    s.add(b)
    step(s)  # both prefill: 2 blocks each, cache full
    assert s.block_manager.num_free_blocks == 0
    step(s)  # token 8 of each still fits the second block
    _, batch = step(s)  # a needs a third block: b (youngest) is preempted
    assert batch.preempted == [b] and b.status is SequenceStatus.WAITING and b.block_table == []
    assert b.num_tokens == 9 and b.num_computed_tokens == 0
    finished = []
    for _ in range(40):
        if not s.has_unfinished():
            break
        _, batch = step(s)
        finished += [q for q in (a, b) if q.is_finished and q not in finished]
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH
    assert a.num_output_tokens == 9 and b.num_output_tokens == 9
    assert b.num_preemptions >= 1
    assert s.block_manager.num_free_blocks == 4


def test_abort_frees_blocks_at_once_running_or_waiting():
    s = make(block_size=4, num_kv_blocks=8, max_num_seqs=1, max_model_len=32)
    s.add(seq("a", 9))
    s.add(seq("b", 3))
    step(s)
    assert s.block_manager.num_free_blocks == 5
    assert s.abort("a") is not None
    assert s.block_manager.num_free_blocks == 8 and not s.running
    assert s.abort("b").finish_reason is FinishReason.ABORT
    assert not s.has_unfinished() and s.abort("nope") is None


def test_max_tokens_eos_and_stop_ids():
    s = make(block_size=4, max_model_len=64)
    seqs = {
        "len": seq("len", 3, max_tokens=2),
        "eos": seq("eos", 3, max_tokens=10),
        "ign": seq("ign", 3, max_tokens=3, ignore_eos=True),
        "stopid": seq("stopid", 3, max_tokens=10, stop_token_ids=(7,)),
    }
    for q in seqs.values():
        s.add(q)
    plan = [
        {"len": 5, "eos": 5, "ign": EOS, "stopid": 5},
        {"len": 5, "eos": EOS, "ign": EOS, "stopid": 7},
        {"ign": 5},
    ]
    for tokens in plan:
        batch = s.schedule()
        assert {q.request_id for q in batch.sampling_seqs} == set(tokens)
        s.advance(batch)
        s.postprocess(batch, [tokens[q.request_id] for q in batch.sampling_seqs])
    reasons = {rid: q.finish_reason for rid, q in seqs.items()}
    assert reasons == {
        "len": FinishReason.LENGTH,
        "eos": FinishReason.STOP,
        "ign": FinishReason.LENGTH,
        "stopid": FinishReason.STOP,
    }
    assert seqs["ign"].output_token_ids == [EOS, EOS, 5]
    assert not s.has_unfinished()
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_a_sequence_past_max_model_len_is_a_defect_of_its_maker():
    """The budget is checked where the request is made (RequestBudget); the scheduler asserts it."""
    s = make(block_size=4, max_model_len=16)
    with pytest.raises(AssertionError):
        s.add(seq("big", 12, max_tokens=5))
    s.add(seq("fits", 12, max_tokens=4))
    for _ in range(10):
        step(s)
    assert not s.has_unfinished()


def test_a_decode_that_never_stops_is_impossible():
    s = make(block_size=4, max_model_len=24, default_max_tokens=5)
    q = seq("r", 4, max_tokens=20)
    s.add(q)
    steps = 0
    while s.has_unfinished():
        step(s)
        steps += 1
        assert steps < 100
    assert q.num_tokens == 24 and q.finish_reason is FinishReason.LENGTH


def test_requests_that_arrived_since_the_last_step_are_prefilled_in_one_step():
    s = make(block_size=4, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64)
    s.add(seq("first", 5))
    step(s)
    for i in range(8):  # eight arrivals while "first" decodes: one step takes them all
        s.add(seq(f"c{i}", 6))
    sched, batch = step(s)
    assert sched == [("first", 1)] + [(f"c{i}", 6) for i in range(8)]
    assert [q.request_id for q in batch.admitted] == [f"c{i}" for i in range(8)]
    assert len(batch.sampling_seqs) == 9  # every new request samples its first token in that step


def test_a_long_prompt_takes_at_most_the_cap_while_others_decode():
    s = make(block_size=4, max_num_batched_tokens=32, max_model_len=64, prefill_tokens_while_decoding=8)
    s.add(seq("a", 3, max_tokens=6))
    s.add(seq("b", 3, max_tokens=6))
    assert step(s)[0] == [("a", 3), ("b", 3)]  # nothing decodes yet: no cap
    s.add(seq("long", 30))
    steps = [step(s)[0] for _ in range(4)]
    assert steps[0] == [("a", 1), ("b", 1), ("long", 8)]
    assert steps[1] == [("a", 1), ("b", 1), ("long", 8)]
    assert steps[2] == [("a", 1), ("b", 1), ("long", 8)]
    assert steps[3] == [("a", 1), ("b", 1), ("long", 6)]  # the rest of its prompt, then it samples
    assert s.seqs["long"].num_output_tokens == 1


def test_the_cap_shares_between_a_running_chunk_and_new_arrivals():
    s = make(block_size=4, max_num_batched_tokens=32, max_model_len=64, prefill_tokens_while_decoding=10)
    s.add(seq("a", 3, max_tokens=8))
    step(s)
    s.add(seq("long", 30))
    assert step(s)[0] == [("a", 1), ("long", 10)]
    s.add(seq("late", 4))
    assert step(s)[0] == [("a", 1), ("long", 10)]  # the chunk under way first: "late" waits
    assert step(s)[0] == [("a", 1), ("long", 10)]  # the prompt's last chunk: it samples
    assert step(s)[0] == [("a", 1), ("long", 1), ("late", 4)]  # two decodes, then the next prompt


def test_without_decodes_a_prompt_takes_the_whole_budget():
    s = make(block_size=4, max_num_batched_tokens=32, max_model_len=64, prefill_tokens_while_decoding=8)
    s.add(seq("long", 40))
    assert step(s)[0] == [("long", 32)]
    assert step(s)[0] == [("long", 8)]


def test_decodes_are_scheduled_before_prompt_work_whatever_the_running_order():
    s = make(block_size=4, max_num_batched_tokens=16, max_model_len=64)
    s.add(seq("long", 40))
    s.add(seq("d", 3, max_tokens=8))
    assert step(s)[0] == [("long", 16)]
    long, d = s.seqs["long"], s.seqs["d"]
    s.waiting.remove(d)  # put "d" in the running set behind the long prompt's chunks, as if readmitted
    s.block_manager.allocate(d, 3)
    d.status = SequenceStatus.RUNNING
    d.num_computed_tokens = 3
    d.token_ids.append(5)
    s.running.append(d)
    assert s.running == [long, d]
    sched, _ = step(s)
    assert sched == [("d", 1), ("long", 15)]  # the decode first; the chunk takes what is left
