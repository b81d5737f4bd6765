"""Prefix caching on the fake model and in the block manager: what is reused, what is never freed.

The fuzz drives the scheduler through random add / step / abort / preempt sequences and checks it
against a simple model of the cache: which content every block holds (updated from the writes each
step makes), so a block handed to a new owner while another still reads it is caught.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.block_manager import BlockManager
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.scheduler import Scheduler
from omnistage.services.thinker.engine.sequence import SamplingParams, Sequence, SequenceStatus

from tests.services.thinker.engine.engine_fakes import make_fake_engine

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 128) for _ in range(n)]


def run_one(engine, prompt: list[int], params: SamplingParams = GREEDY):
    """One request alone through `engine.step()`: (tokens, its final usage)."""
    engine.add_prompt(f"r{engine.num_steps}-{len(prompt)}", prompt, params)
    out, usage = [], None
    while engine.has_unfinished():
        for o in engine.step():
            out += o.token_ids
            usage = o.usage if o.finished else usage
    return out, usage


def test_a_second_identical_request_is_mostly_cached_and_gives_the_same_tokens():
    engine = make_fake_engine(block_size=8, max_model_len=256, max_num_batched_tokens=256)
    prompt = tokens(100, seed=1)
    first, u1 = run_one(engine, prompt)
    second, u2 = run_one(engine, prompt)
    assert u1.cached_prompt_tokens == 0
    assert u2.cached_prompt_tokens == 96 >= 0.8 * len(prompt)  # all full blocks but the last token's
    assert second == first
    stats = engine.scheduler.block_manager.stats
    assert (stats.queried_tokens, stats.hit_tokens) == (200, 96)


def test_a_block_aligned_prompt_still_computes_its_last_token():
    engine = make_fake_engine(block_size=8, max_model_len=256)
    prompt = tokens(64, seed=2)
    first, _ = run_one(engine, prompt)
    second, usage = run_one(engine, prompt)
    assert usage.cached_prompt_tokens == 56 and second == first


def test_a_shared_system_prompt_is_cached_and_the_new_question_is_not():
    engine = make_fake_engine(block_size=8, max_model_len=256)
    system = tokens(43, seed=3)
    run_one(engine, system + tokens(20, seed=4))
    answer, usage = run_one(engine, system + tokens(25, seed=5))
    assert usage.cached_prompt_tokens == 40  # the system prompt's full blocks
    off = make_fake_engine(block_size=8, max_model_len=256, prefix_caching=False)
    assert run_one(off, system + tokens(25, seed=5))[0] == answer


def test_the_next_turn_hits_the_previous_answer_too():
    """Decode blocks are indexed: prompt + answer + a new question reuses both."""
    engine = make_fake_engine(block_size=8, max_model_len=256)
    prompt = tokens(30, seed=6)
    answer, _ = run_one(engine, prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    _, usage = run_one(engine, prompt + answer + tokens(10, seed=7))
    assert usage.cached_prompt_tokens == (30 + 20 - 1) // 8 * 8  # the last answer token was never computed


@pytest.mark.parametrize(
    "kw",
    [dict(max_num_batched_tokens=16), dict(max_num_batched_tokens=64, num_kv_blocks=24)],
    ids=["chunked", "preempting"],
)
def test_greedy_tokens_identical_with_and_without_caching(kw):
    """Many requests sharing prefixes, chunked or preempted: caching changes no token."""
    system = tokens(40, seed=8)
    prompts = [system + tokens(random.Random(i).randrange(1, 60), seed=100 + i) for i in range(12)]
    prompts += prompts[:4]  # exact repeats
    off = make_fake_engine(block_size=8, max_model_len=256, prefix_caching=False, **kw)
    on = make_fake_engine(block_size=8, max_model_len=256, **kw)
    want = [r.token_ids for r in off.generate(prompts[:6], GREEDY)] + [
        r.token_ids for r in off.generate(prompts[6:], GREEDY)
    ]
    got = [r.token_ids for r in on.generate(prompts[:6], GREEDY)] + [
        r.token_ids for r in on.generate(prompts[6:], GREEDY)
    ]
    assert got == want
    stats = on.scheduler.block_manager.stats
    assert stats.hit_tokens >= 10 * 40 // 8 * 8  # the later requests found the system prompt at least
    assert on.scheduler.block_manager.num_free_blocks == on.cfg.num_kv_blocks
    if "num_kv_blocks" in kw:
        assert stats.evicted_blocks > 0


def test_turned_off_nothing_is_indexed():
    engine = make_fake_engine(block_size=8, max_model_len=256, prefix_caching=False)
    prompt = tokens(50, seed=9)
    run_one(engine, prompt)
    _, usage = run_one(engine, prompt)
    bm = engine.scheduler.block_manager
    assert usage.cached_prompt_tokens == 0 and bm.num_cached_blocks == 0 and bm.stats.hit_tokens == 0


# --- the block manager alone ------------------------------------------------------------------------


def seq(ids: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, ids, SamplingParams(), max_tokens=8)


def compute(bm: BlockManager, s: Sequence) -> None:
    """Allocate and 'compute' all of `s`'s tokens (what one prefill step does)."""
    bm.allocate(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.index_computed(s)


def test_freed_blocks_stay_reusable_until_evicted_least_recent_first_and_tail_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(list(range(13)), "a")  # 3 full blocks + 1 token
    compute(bm, a)
    full = a.block_table[:3]
    assert bm.num_cached_blocks == 3
    bm.free(a)
    assert bm.num_free_blocks == 6 and list(bm.cached_free) == full[::-1]  # the tail goes first
    b = seq(list(range(13)) + [99], "b")
    assert bm.match_prefix(b) == full
    # Blocks needed by other content: plain ones first (3), then the cached tail.
    c = seq(list(range(100, 116)), "c")
    bm.allocate(c, 16)
    assert bm.stats.evicted_blocks == 1 and bm.match_prefix(b) == full[:2]


def test_a_held_block_is_never_handed_out():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(9)), "a")
    compute(bm, a)  # 3 blocks held
    b = seq(list(range(9)) + [5, 6, 7], "b")
    prefix = bm.match_prefix(b)
    assert prefix == a.block_table[:2] and bm.can_admit(b, prefix, 4)
    bm.take_prefix(b, prefix)
    assert bm.ref_counts[prefix[0]] == 2 and b.num_computed_tokens == 8
    assert not bm.can_allocate(seq(list(range(50, 58)), "c"), 8)  # 1 free block, nothing evictable
    bm.free(a)
    assert all(bm.ref_counts[x] == 1 for x in prefix) and bm.num_free_blocks == 2


def test_a_full_block_computed_twice_is_indexed_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(list(range(9)), "a"), seq(list(range(9)), "b")
    bm.allocate(a, 9)
    bm.allocate(b, 9)  # admitted together: neither found the other
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.index_computed(s)
    assert bm.num_cached_blocks == 2 and bm.index[a.block_keys[0]] == a.block_table[0]
    bm.free(b)
    assert bm.num_free_blocks == 5 and len(bm.free_block_ids) == 5  # b's copies are plain blocks


# --- fuzz: the scheduler against a simple model of the cache -----------------------------------------

BS = 4
op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 24), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(0, 9)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
)


class CacheModel:
    """What each block holds, from the writes of each step: a full block's key once it is computed
    whole in one owner's table, else ("partial", owner)."""

    def __init__(self) -> None:
        self.content: dict[int, object] = {}

    def write(self, s: Sequence, start: int, end: int) -> None:
        for i in range(start // BS, -(-end // BS)):
            full = (i + 1) * BS <= end
            self.content[s.block_table[i]] = (
                s.keys_of_full_blocks(BS, i + 1)[i] if full else ("partial", s.seq_id)
            )


def check(s: Scheduler, model: CacheModel) -> None:
    bm = s.block_manager
    held = Counter(b for q in s.running for b in q.block_table)
    assert all(bm.ref_counts[b] == held.get(b, 0) for b in range(bm.num_blocks))
    free = list(bm.free_block_ids) + list(bm.cached_free)
    assert len(free) == len(set(free)) and {b for b in range(bm.num_blocks) if not held[b]} == set(free)
    assert all(bm.block_key[b] is None for b in bm.free_block_ids)
    for key, b in bm.index.items():
        assert bm.block_key[b] == key and model.content.get(b) == key  # indexed content is what it says
    for q in s.running:  # what a running sequence reads is still its own content
        n = q.num_computed_tokens // BS
        assert [model.content.get(b) for b in q.block_table[:n]] == q.keys_of_full_blocks(BS, n)
    for q in s.waiting:
        assert q.block_table == [] and q.num_computed_tokens == 0


class Steps:
    """Steps the scheduler as the engine does: synchronous (`lag` 0), or with async scheduling
    (`lag` 1: each step is scheduled and launched before the previous one's ids are postprocessed).
    A launched step's writes go to the blocks its sequences held at launch (a sequence that ended
    meanwhile leaves garbage there); a full block's key is known once its last token is."""

    def __init__(self, s: Scheduler, model: CacheModel, lag: int, rng: random.Random) -> None:
        self.s, self.model, self.lag, self.rng = s, model, lag, rng
        self.in_flight: list = []

    def step(self, sampled=None) -> None:
        batch = self.s.schedule()
        writes = [
            (q, q.num_computed_tokens, q.num_computed_tokens + k, list(q.block_table))
            for q, k in batch.scheduled
        ]
        self.s.advance(batch)
        self.in_flight.append(batch)
        while len(self.in_flight) > self.lag:
            done = self.in_flight.pop(0)
            # 0 is the EOS: a sequence may end while the next step, which holds it, runs.
            self.s.postprocess(done, [self.rng.randrange(0, 8) for _ in done.sampling_seqs])
        for q, start, end, table in writes:
            self._write(q, start, end, table)

    def flush(self) -> None:
        while self.in_flight:
            done = self.in_flight.pop(0)
            self.s.postprocess(done, [1] * len(done.sampling_seqs))

    def _write(self, q: Sequence, start: int, end: int, table: list[int]) -> None:
        known = q.num_tokens - q.num_pending
        for i in range(start // BS, -(-end // BS)):
            if (i + 1) * BS <= end and (i + 1) * BS <= known:
                self.model.content[table[i]] = q.keys_of_full_blocks(BS, i + 1)[i]
            else:
                self.model.content[table[i]] = ("partial", q.seq_id)


@pytest.mark.parametrize("lag", [0, 1], ids=["sync", "async"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=60), st.integers(4, 14))
def test_fuzz_add_finish_preempt_never_loses_a_block_in_use(lag, ops, num_blocks):
    cfg = resolve_engine_config(
        EngineConfig(
            block_size=BS,
            num_kv_blocks=num_blocks,
            max_model_len=num_blocks * BS,
            max_num_batched_tokens=12,
            max_num_seqs=4,
        )
    )
    s, model = Scheduler(cfg, [0]), CacheModel()
    steps = Steps(s, model, lag, random.Random(0))
    prefixes = [tokens(16, seed=i) for i in range(4)]
    for n, action in enumerate(ops):
        kind = action[0]
        if kind == "add":
            _, which, length, max_tokens = action
            ids = (prefixes[which] + tokens(24, seed=n))[:length]
            if length + max_tokens <= cfg.max_model_len:
                s.add(Sequence(f"q{n}", ids, SamplingParams(), max_tokens))
        elif kind == "step":
            steps.step()
        elif s.seqs:
            victim = sorted(s.seqs.values(), key=lambda q: q.seq_id)[action[1] % len(s.seqs)]
            if kind == "abort":
                s.abort(victim.request_id)
            elif victim.status is SequenceStatus.RUNNING and not victim.num_pending:
                # (The scheduler preempts only while scheduling, where it admits nobody: a sequence
                # preempted with a token pending waits for it before it can come back.)
                s.running.remove(victim)
                s._preempt(victim)
        check(s, model)
    while s.has_unfinished():  # everything finishes, and every block comes back
        steps.step()
        check(s, model)
    steps.flush()
    assert s.block_manager.num_free_blocks == num_blocks
