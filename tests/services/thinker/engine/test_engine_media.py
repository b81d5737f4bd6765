"""Multimodal prompts through the engine on the tiny checkpoint: the encoder rows spliced into the
placeholder slots, the vision / audio routers and the 3D positions give the logits of a direct model
forward whose inputs were built by hand (mm_prompts.reference_inputs); chunked prefill, preemption
(recompute re-splices the rows) and TP=2 give the one-shot TP=1 tokens."""

from __future__ import annotations

import functools

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.common.transport import TransportContext
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.media import MultimodalPrompt
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.engine.step_plan import build_step_plan
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.loader import load_model
from omnistage.services.thinker.multimodal import MediaInputs
from omnistage.services.thinker.tp.plan import StepPlan

from tests.services.thinker.engine.mm_prompts import MIXED, Part, items, layout, reference_inputs
from tests.services.thinker.engine.tp_run import run_tp2

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PARTS: list[list[Part]] = [
    MIXED,
    [("text", 4), ("image", (3, 3)), ("image", (2, 4)), ("text", 6)],
    [("text", 2), ("audio", 9), ("text", 5)],
    [("text", 3), ("video", [(2, 3), (2, 3), (2, 3)]), ("text", 4), ("audio", 3), ("text", 1)],
]
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


def mm_prompts(ckpt) -> list[MultimodalPrompt]:
    """The PARTS prompts as the servicer builds them (deterministic: TP ranks' processes agree)."""
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    inputs = MediaInputs(cfg, torch.float32, TransportContext())
    out = []
    for seed, parts in enumerate(PARTS):
        ids, media = layout(cfg, parts, seed=seed)
        out.append(inputs.build(ids, items(cfg, media)))
    inputs.close()
    return out


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def one_shot(tiny_ckpt) -> list[list[int]]:
    """Each prompt alone, prefilled in one step."""
    e = engine(tiny_ckpt, max_num_batched_tokens=256)
    return [e.generate([p], GREEDY)[0].token_ids for p in mm_prompts(tiny_ckpt)]


@torch.inference_mode()
def direct_logits(model, ids: list[int], media, extra: list[int] = ()) -> torch.Tensor:
    """Logits of every position of ids + extra (generated tokens) by one forward of the hand-built inputs."""
    cfg = model.config
    weight = model.model.word_embeddings.weight
    embeds, modality, positions, delta = reference_inputs(cfg, weight, ids, media)
    n = len(ids) + len(extra)
    embeds = torch.cat([embeds, weight[torch.tensor(list(extra), dtype=torch.long)]])
    modality = torch.cat([modality, torch.zeros(len(extra), dtype=torch.int8)])
    decode = (torch.arange(len(ids), n) + delta).expand(3, -1)
    hidden = model(
        torch.zeros(n, dtype=torch.long), torch.cat([positions, decode], 1), modality, inputs_embeds=embeds
    )
    return model.compute_logits(hidden)


def test_first_logits_equal_a_direct_forward_with_the_rows_spliced_by_hand(tiny_ckpt, model):
    e = engine(tiny_ckpt, max_num_batched_tokens=256)
    cfg = model.config
    ids, media = layout(cfg, MIXED)
    prompt = MediaInputs(cfg, torch.float32, TransportContext()).build(ids, items(cfg, media))
    e.add_prompt("r", prompt, GREEDY)
    plan = build_step_plan(e.scheduler.schedule().scheduled, e.cfg.block_size)
    assert plan.num_media_rows == sum(m.rows.shape[0] for m in media)
    logits = e.runner.execute(plan)
    want = direct_logits(model, ids, media)[-1:]
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    # Each ingredient matters: the rows, the routers picked per token, the 3D positions.
    with torch.inference_mode():
        embeds, modality, positions, _ = reference_inputs(cfg, model.model.word_embeddings.weight, ids, media)
        ids_t = torch.tensor(ids)
        variants = {
            "placeholder embeddings": model(ids_t, positions, modality),
            "text router only": model(ids_t, positions, None, inputs_embeds=embeds),
            "1D positions": model(
                ids_t, torch.arange(len(ids)).expand(3, -1), modality, inputs_embeds=embeds
            ),
        }
    for name, hidden in variants.items():
        assert (model.compute_logits(hidden[-1:]) - want).abs().max() > 1e-3, name


def test_greedy_tokens_equal_direct_reforwards_with_rope_delta(tiny_ckpt, model, one_shot):
    cfg = model.config
    ids, media = layout(cfg, MIXED, seed=0)
    out = one_shot[0]
    logits = direct_logits(model, ids, media, out)
    assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == out


@pytest.mark.parametrize(
    "kw",
    [dict(max_num_batched_tokens=16), dict(max_num_batched_tokens=16, num_kv_blocks=6)],
    ids=["chunked", "preempting"],
)
def test_chunked_and_preempted_prefill_give_the_one_shot_tokens(tiny_ckpt, one_shot, kw):
    e = engine(tiny_ckpt, **kw)
    plans: list[StepPlan] = []
    run = e.runner.execute_step
    e.runner.execute_step = lambda plan: (plans.append(plan), run(plan))[1]
    preempted = []
    preempt = e.scheduler._preempt
    e.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    results = e.generate(mm_prompts(tiny_ckpt), GREEDY)
    assert [r.token_ids for r in results] == one_shot
    rows = sum(p.num_media_rows for p in plans)
    total = sum(p.media.num_rows for p in mm_prompts(tiny_ckpt))
    if "num_kv_blocks" in kw:
        assert preempted and rows > total  # recompute spliced rows again
    else:
        assert rows == total and sum(p.num_media_rows > 0 for p in plans) > len(PARTS)  # split over chunks
    assert all(
        p.num_media_rows == 0 for p in plans if int(p.query_lens.max()) == 1
    )  # decode plans carry none
    assert e.scheduler.block_manager.num_free_blocks == e.cfg.num_kv_blocks


def test_step_plan_carries_the_media_index_but_never_the_rows():
    plan = StepPlan(
        input_ids=torch.arange(5),
        positions=torch.arange(5).expand(3, -1),
        query_lens=torch.tensor([5]),
        context_lens=torch.tensor([5]),
        slot_mapping=torch.arange(5),
        block_tables=torch.zeros(1, 1, dtype=torch.long),
        sample_rows=torch.tensor([4]),
        media_index=torch.tensor([1, 2]),
        media_modality=torch.tensor([1, 2]),
        media_rows=torch.ones(2, 8),
    )
    back = StepPlan.decode(plan.encode())
    assert back.media_index.tolist() == [1, 2] and back.media_modality.tolist() == [1, 2]
    assert back.media_rows is None and back.input_ids.tolist() == list(range(5))
    # hidden-state rows travel too: which steps a graph covers reads them, alike on every rank
    plan.hidden_index = torch.tensor([2, 3])
    assert StepPlan.decode(plan.encode()).hidden_index.tolist() == [2, 3]
    plan.hidden_index = torch.zeros(0, dtype=torch.long)
    assert (
        plan.encode().numel()
        == StepPlan(
            **{
                **plan.__dict__,
                "media_index": torch.zeros(0, dtype=torch.long),
                "media_modality": torch.zeros(0, dtype=torch.long),
            }
        )
        .encode()
        .numel()
        + 4
    )


# --- TP=2 (gloo): rank 0 alone holds the rows, the embedding all-reduce hands them over --------------


def _tp_tokens(ckpt: str, e: LLMEngine) -> list[list[int]]:
    return [r.token_ids for r in e.generate(mm_prompts(ckpt), GREEDY, timeout_s=DEADLINE_S)]


@pytest.mark.slow
def test_tp2_gives_the_tp1_greedy_tokens(tiny_ckpt, one_shot):
    cfg = EngineConfig(block_size=16, max_model_len=256, max_num_batched_tokens=32)
    assert run_tp2(functools.partial(_tp_tokens, str(tiny_ckpt)), tiny_ckpt, cfg, DEADLINE_S) == one_shot
