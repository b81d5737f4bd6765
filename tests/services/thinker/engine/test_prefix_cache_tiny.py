"""Prefix caching on the tiny checkpoint: a hit changes no token (chunked prefill, TP=2 too), an
image prompt hits only for the same image rows, a hidden-state request still computes its slots."""

from __future__ import annotations

import random

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.common.transport import TransportContext
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.media import Prompt
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.multimodal import MediaInputs

from tests.services.thinker.engine.mm_prompts import items, layout
from tests.services.thinker.engine.tp_run import run_tp2

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
DEADLINE_S = 120


def engine(ckpt, **kw) -> LLMEngine:
    """Rank 0's engine after the warm-up a service runs on a plain CPU (each path once; the full
    warm-up's every shape is test_warmup.py's and the simulated-device tests')."""
    return rank0_engine(
        start_rank(
            RankConfig(
                str(ckpt), EngineConfig(**{"block_size": 16, "max_model_len": 256, **kw}), full_warmup=False
            )
        )
    )


def shared_prefix_prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Two waves: the first computes a system prompt; the second repeats it with new questions and
    repeats two first-wave prompts exactly."""
    rng = random.Random(5)
    system = [rng.randrange(0, 900) for _ in range(70)]
    ask = lambda: [rng.randrange(0, 900) for _ in range(rng.randrange(1, 40))]  # noqa: E731
    first = [system + ask() for _ in range(3)]
    return first, [system + ask() for _ in range(3)] + first[:2]


def waves(e: LLMEngine) -> tuple[list[list[int]], list[int]]:
    """Tokens of both waves and the second wave's cached prompt tokens."""
    first, second = shared_prefix_prompts()
    out = [r.token_ids for r in e.generate(first, GREEDY)]
    cached = []
    for i, p in enumerate(second):
        e.add_prompt(f"w{i}", p, GREEDY)
    ends = {}
    while e.has_unfinished():
        for o in e.step():
            ends.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                cached.append((o.request_id, o.usage.cached_prompt_tokens))
    out += [ends[f"w{i}"] for i in range(len(second))]
    return out, [c for _, c in sorted(cached)]


@pytest.fixture(scope="module")
def uncached(tiny_ckpt):
    return waves(engine(tiny_ckpt, max_num_batched_tokens=256, prefix_caching=False))


@pytest.mark.parametrize(
    "kw", [dict(max_num_batched_tokens=256), dict(max_num_batched_tokens=24)], ids=["one-shot", "chunked"]
)
def test_greedy_tokens_identical_with_and_without_a_hit(tiny_ckpt, uncached, kw):
    tokens, cached = waves(engine(tiny_ckpt, **kw))
    assert tokens == uncached[0]
    assert uncached[1] == [0] * 5
    assert all(c >= 64 for c in cached)  # the system prompt's 4 full blocks at least
    assert cached[3:] == [len(p) - 1 - (len(p) - 1) % 16 for p in shared_prefix_prompts()[1][3:]]


def image_prompt(ckpt, seed_rows: int) -> Prompt:
    """Text, a 4x4 image whose rows come from `seed_rows`, text: the same ids whatever the rows."""
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    ids, media = layout(cfg, [("text", 40), ("image", (4, 4)), ("text", 20)], seed=0)
    gen = torch.Generator().manual_seed(seed_rows)
    media[0].rows = torch.nn.functional.normalize(torch.randn(media[0].rows.shape, generator=gen), dim=-1)
    inputs = MediaInputs(cfg, torch.float32, TransportContext())
    try:
        return inputs.build(ids, items(cfg, media))
    finally:
        inputs.close()


def test_an_image_prompt_hits_only_for_the_same_image(tiny_ckpt):
    e = engine(tiny_ckpt, max_num_batched_tokens=256)
    off = engine(tiny_ckpt, max_num_batched_tokens=256, prefix_caching=False)
    a, b = image_prompt(tiny_ckpt, 1), image_prompt(tiny_ckpt, 2)
    assert a.token_ids == b.token_ids and not torch.equal(a.media.rows, b.media.rows)
    n = len(a.token_ids)
    first = e.generate([a], GREEDY)[0].token_ids
    stats = e.scheduler.block_manager.stats
    for prompt, want_hit in ((b, 32), (a, (n - 1) // 16 * 16)):  # b: the text before the image's block only
        before = stats.hit_tokens
        got = e.generate([prompt], GREEDY)[0].token_ids
        assert stats.hit_tokens - before == want_hit
        assert got == off.generate([prompt], GREEDY)[0].token_ids
    assert got == first


def test_a_hidden_state_request_computes_every_slot_it_wants(tiny_ckpt):
    from tests.services.thinker.engine.test_engine_hidden_states import hidden_prompt

    prompt = hidden_prompt(tiny_ckpt, [("text", 40)], seed=3)[0]
    first_slot = int(prompt.hidden_slots[0])
    e = engine(tiny_ckpt, max_num_batched_tokens=64, max_model_len=512)
    states = []
    for _ in range(2):
        e.add_prompt(f"h{len(states)}", prompt, SamplingParams())
        while e.has_unfinished():
            for o in e.step():
                states.append((o.hidden_states, o.usage.cached_prompt_tokens))
    (first, c1), (second, c2) = states
    assert (c1, c2) == (0, first_slot // 16 * 16) and c2 > 0
    torch.testing.assert_close(second, first, rtol=1e-5, atol=1e-5)


# --- TP=2 (gloo): rank 0 decides, the block tables in the plan carry the hits ----------------------


@pytest.mark.slow
def test_tp2_hits_give_the_tp1_uncached_tokens(tiny_ckpt, uncached):
    cfg = EngineConfig(block_size=16, max_model_len=256, max_num_batched_tokens=24)
    tokens, cached = run_tp2(waves, tiny_ckpt, cfg, DEADLINE_S)
    assert tokens == uncached[0] and all(c >= 64 for c in cached)
