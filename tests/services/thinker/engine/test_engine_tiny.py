"""The engine on the real tiny checkpoint (TP=1): batch invariance, paged cache == full forward."""

from __future__ import annotations

import random

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.detokenizer import Detokenizer
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.models.layers.attention import AttentionMetadata, attention_metadata

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 900) for _ in range(rng.randrange(3, 120))] for _ in range(n)]


def engine(ckpt, **kw) -> LLMEngine:
    """Rank 0's engine after the warm-up a service runs on a plain CPU (each path once; the full
    warm-up's every shape is test_warmup.py's and the simulated-device tests')."""
    return rank0_engine(
        start_rank(
            RankConfig(str(ckpt), EngineConfig(block_size=16, max_model_len=256, **kw), full_warmup=False)
        )
    )


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    e = engine(tiny_ckpt, max_num_batched_tokens=512)
    return [e.generate([p], GREEDY)[0].token_ids for p in prompts(32)[:4]]


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_num_batched_tokens=64),
        dict(max_num_batched_tokens=256, chunked_prefill=False),
        dict(max_num_batched_tokens=64, num_kv_blocks=20),
        dict(max_num_batched_tokens=256, prefill_tokens_while_decoding=24),
        dict(max_num_batched_tokens=64, num_kv_blocks=20, async_scheduling="on"),
    ],
    ids=["chunked", "unchunked", "preempting", "capped-while-decoding", "preempting-async"],
)
def test_greedy_tokens_identical_alone_or_among_31_others(tiny_ckpt, reference, kw):
    e = engine(tiny_ckpt, **kw)
    preempted = []
    orig = e.scheduler._preempt
    e.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))
    results = e.generate(prompts(32), GREEDY)
    assert [r.token_ids for r in results[:4]] == reference
    assert all(len(r.token_ids) == 16 and r.finish_reason is FinishReason.LENGTH for r in results)
    assert bool(preempted) == ("num_kv_blocks" in kw)
    assert e.scheduler.block_manager.num_free_blocks == e.cfg.num_kv_blocks


def test_paged_decode_equals_full_reforward(tiny_ckpt):
    e = engine(tiny_ckpt, max_num_batched_tokens=32)
    p = prompts(1, seed=9)[0]
    result = e.generate([p], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    out = result.token_ids
    # generate() keeps the final output's usage (a benchmark's decode rate reads its time to first token)
    assert result.usage.completion_tokens == len(out) == 12 and result.usage.prompt_tokens == len(p)
    assert result.usage.time_to_first_token_ms > 0
    model = e.runner.model
    for layer in model.attention_layers():
        layer.k_cache = layer.v_cache = torch.empty(0)
    full = torch.tensor(p + out)
    with torch.inference_mode(), attention_metadata(AttentionMetadata.no_cache([len(full)])):
        logits = model.compute_logits(model(full, torch.arange(len(full)).expand(3, -1)))
    assert logits[len(p) - 1 : -1].argmax(-1).tolist() == out


def test_seeded_sampling_reproducible_in_a_batch(tiny_ckpt):
    e = engine(tiny_ckpt, max_num_batched_tokens=64)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = e.generate([prompts(1)[0]], params)[0].token_ids
    mixed = e.generate(prompts(8), [params] + [SamplingParams(temperature=1.0, max_tokens=12)] * 7)[
        0
    ].token_ids
    assert alone == mixed


def test_real_tokenizer_streams_chinese_and_emoji_whole(tiny_ckpt):
    from omnistage.services.thinker.models.tokenizer import MingTokenizer

    tok = MingTokenizer(tiny_ckpt)
    text = "你好世界 🙂👍 naïve café —— 结束"
    ids = tok.encode(text)
    detok = Detokenizer(tok, tok.encode("<role>ASSISTANT</role>"))
    deltas = [detok.add(t) for t in ids] + [detok.finish()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_the_engines_rope_table_gives_the_computed_ropes_tokens(tiny_ckpt, reference):
    """The engine's steps gather their rope from the table its runner bounded by max_model_len (the
    reference's too); the same engine computing the rope gives the same greedy tokens."""
    e = engine(tiny_ckpt, max_num_batched_tokens=512)
    rotary = e.runner.model.model.rotary
    assert rotary.span == (-128, 512)  # video_rope's span of max_model_len 256
    (table,) = rotary._tables.values()  # made by the warm-up's first step, and kept
    assert table.rows.shape == (640, 2, 64) and table.lo == -128
    e.runner.model.bound_positions(None)
    assert [e.generate([p], GREEDY)[0].token_ids for p in prompts(32)[:4]] == reference
