"""Hidden-state mode through the engine on the tiny checkpoint (image generation's conditioning, ming.md
§6.1): the query block appended after the prompt, its slots filled with `mlp/`'s query rows, routed
by the image gate at the (1, 2, 512)-grid positions, gives the final-norm hidden states of a direct
model forward whose inputs were built by hand; chunked prefill, preemption and TP=2 give the same
states; no LM head runs, no token is generated and the KV blocks are free at once."""

from __future__ import annotations

import functools

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.common.transport import TransportContext
from omnistage.services.thinker.engine.budget import RequestError
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.media import MultimodalPrompt
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.image_queries import load_image_queries
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.loader import load_model
from omnistage.services.thinker.multimodal import MediaInputs

from tests.services.thinker.engine.mm_prompts import Media, items, layout, reference_inputs
from tests.services.thinker.engine.tp_run import run_tp2

MAX_MODEL_LEN = 512
DEADLINE_S = 120
TEXT_ONLY = [("text", 9)]
WITH_IMAGE = [("text", 5), ("image", (2, 3)), ("text", 4)]  # an edit: the reference is an ordinary <image>


def engine(ckpt, **kw) -> LLMEngine:
    """Rank 0's engine after the warm-up a service runs on a plain CPU (each path once; the full
    warm-up's every shape is test_warmup.py's and the simulated-device tests')."""
    return rank0_engine(
        start_rank(
            RankConfig(
                str(ckpt),
                EngineConfig(**{"block_size": 16, "max_model_len": MAX_MODEL_LEN, **kw}),
                full_warmup=False,
            )
        )
    )


def queries(ckpt) -> torch.Tensor:
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    return load_image_queries(ckpt, cfg.hidden_size, torch.float32)


def hidden_prompt(ckpt, parts, seed: int = 0) -> tuple[MultimodalPrompt, list[int], list[Media]]:
    """(the servicer's hidden-state prompt, the prompt's own ids, its media) of `parts`."""
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    ids, media = layout(cfg, parts, seed=seed)
    inputs = MediaInputs(cfg, torch.float32, TransportContext(), queries(ckpt))
    try:
        return inputs.build(ids, items(cfg, media), image_queries=True), ids, media
    finally:
        inputs.close()


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float32, device="cpu")


@torch.inference_mode()
def direct_hidden(model, ckpt, ids: list[int], media: list[Media]) -> torch.Tensor:
    """The final-norm hidden states at the query slots by one forward of inputs built by hand: the
    block appended, the query rows as stored in `mlp/model.safetensors` (read here with safetensors),
    the image gate on the slots, positions of a (1, 2, 512) grid (ming.md §2.3)."""
    from safetensors.torch import load_file

    cfg = model.config
    rows = load_file(str(ckpt / "mlp" / "model.safetensors"))["query_tokens_dict.16x16"].float()
    tok = cfg.special_tokens
    full = ids + [tok["<image>"]] + [cfg.image_patch_token_id] * 256 + [tok["</image>"]]
    embeds, modality, positions, _ = reference_inputs(
        cfg, model.model.word_embeddings.weight, full, [*media, Media("image", rows, [(1, 1, 256)])]
    )
    p = len(ids) + 1  # the first query slot
    block = positions[:, p : p + 256]
    # The block's positions as the image stage's author states them: t = h = p', w = p' - 127 ... p' + 128.
    start = int(block[0, 0])
    assert block[0].tolist() == [start] * 256 == block[1].tolist()
    assert block[2].tolist() == list(range(start - 127, start + 129))
    assert int(positions[0, p + 256]) == start + 1  # </image> right after
    assert bool((modality[p : p + 256] == 1).all())  # the image gate
    hidden = model(torch.zeros(len(full), dtype=torch.long), positions, modality, inputs_embeds=embeds)
    return hidden[p : p + 256]


@pytest.fixture(scope="module")
def want(tiny_ckpt, model) -> list[torch.Tensor]:
    out = []
    for seed, parts in enumerate([TEXT_ONLY, WITH_IMAGE]):
        _, ids, media = hidden_prompt(tiny_ckpt, parts, seed)
        out.append(direct_hidden(model, tiny_ckpt, ids, media))
    return out


def test_queries_are_the_stored_rows_and_dummy_ones_have_the_shape(tiny_ckpt, tmp_path):
    from safetensors.torch import load_file

    stored = load_file(str(tiny_ckpt / "mlp" / "model.safetensors"))["query_tokens_dict.16x16"]
    rows = load_image_queries(tiny_ckpt, 256, torch.bfloat16)
    assert torch.equal(rows, stored)  # as stored: no re-normalisation
    dummy = load_image_queries(tmp_path, 256, torch.bfloat16, load_format="dummy")
    assert dummy.shape == (256, 256) and dummy.dtype == torch.bfloat16 and dummy.std() > 0
    assert load_image_queries(tmp_path, 256, torch.bfloat16) is None  # no mlp/: hidden-state mode off


def test_the_query_block_through_the_engine_equals_a_direct_forward(tiny_ckpt, want):
    e = engine(tiny_ckpt, max_num_batched_tokens=MAX_MODEL_LEN)
    logits_rows = []
    head = e.runner.model.compute_logits
    e.runner.model.compute_logits = lambda rows: (logits_rows.append(rows.shape[0]), head(rows))[1]
    prompts = [hidden_prompt(tiny_ckpt, parts, seed)[0] for seed, parts in enumerate([TEXT_ONLY, WITH_IMAGE])]
    results = e.generate(prompts)
    for result, expected, prompt in zip(results, want, prompts, strict=True):
        assert result.finish_reason is FinishReason.STOP and result.token_ids == []
        assert result.hidden_states.shape == (256, 256) and result.hidden_states.dtype == torch.float32
        torch.testing.assert_close(result.hidden_states, expected, rtol=1e-5, atol=1e-5)
        assert prompt.token_ids[-1] == ThinkerConfig.from_checkpoint(tiny_ckpt).image_end_token_id
    assert logits_rows == []  # no LM head
    assert e.scheduler.block_manager.num_free_blocks == e.cfg.num_kv_blocks and not e.has_unfinished()


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_num_batched_tokens=48),
        dict(max_num_batched_tokens=64, num_kv_blocks=20),
        dict(max_num_batched_tokens=48, async_scheduling="on"),
        dict(max_num_batched_tokens=64, num_kv_blocks=20, async_scheduling="on"),
    ],
    ids=["chunked", "preempting", "chunked-async", "preempting-async"],
)
def test_chunked_and_preempted_prefill_give_the_same_states(tiny_ckpt, want, kw):
    e = engine(tiny_ckpt, **kw)
    preempted = []
    preempt = e.scheduler._preempt
    e.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    prompts = [hidden_prompt(tiny_ckpt, parts, seed)[0] for seed, parts in enumerate([TEXT_ONLY, WITH_IMAGE])]
    # A long text request first: it samples as if alone, they sample nothing; its blocks make the
    # younger hidden-state requests wait and be preempted when the cache is small.
    text_ids = layout(ThinkerConfig.from_checkpoint(tiny_ckpt), [("text", 180)], seed=7)[0]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = engine(tiny_ckpt, max_num_batched_tokens=MAX_MODEL_LEN).generate([text_ids], greedy)[0].token_ids
    results = e.generate([text_ids, *prompts], [greedy, SamplingParams(), SamplingParams()])
    if "num_kv_blocks" in kw:
        assert set(preempted) & {"generate-1", "generate-2"}  # a hidden-state prefill was recomputed
    assert results[0].token_ids == alone
    for result, expected in zip(results[1:], want, strict=True):
        assert result.token_ids == []
        torch.testing.assert_close(result.hidden_states, expected, rtol=1e-4, atol=1e-4)
    assert e.scheduler.block_manager.num_free_blocks == e.cfg.num_kv_blocks


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_hidden_state_request_frees_its_blocks_when_its_prefill_completes(tiny_ckpt, async_scheduling):
    e = engine(tiny_ckpt, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    prompt, _, _ = hidden_prompt(tiny_ckpt, TEXT_ONLY)
    e.add_prompt("h", prompt, SamplingParams())
    outputs = []
    while e.has_unfinished():
        outputs += e.step()
    ((out,),) = [outputs]
    assert (
        out.finished and out.usage.prompt_tokens == len(prompt.token_ids) and out.usage.completion_tokens == 0
    )
    assert e.scheduler.block_manager.num_free_blocks == e.cfg.num_kv_blocks
    # Aborted half-way: blocks free, nothing kept.
    e.add_prompt("a", prompt, SamplingParams())
    e.step()
    assert e.abort("a").finish_reason is FinishReason.ABORT
    while e.has_unfinished():  # a step launched before the abort completes, giving nothing
        assert e.step() == []
    assert e.scheduler.block_manager.num_free_blocks == e.cfg.num_kv_blocks


def test_a_prompt_whose_block_does_not_fit_is_refused(tiny_ckpt):
    e = engine(tiny_ckpt, max_num_batched_tokens=64, max_model_len=256)
    prompt, _, _ = hidden_prompt(tiny_ckpt, TEXT_ONLY)
    with pytest.raises(
        RequestError, match="^prompt with the image query block: .* exceed max_model_len 256$"
    ):
        e.add_prompt("h", prompt, SamplingParams())


# --- TP=2 (gloo): the final-norm rows are replicated; rank 0 hands them back ------------------------


def _tp_states(ckpt: str, e: LLMEngine) -> list:
    from pathlib import Path

    prompts = [
        hidden_prompt(Path(ckpt), parts, seed)[0] for seed, parts in enumerate([TEXT_ONLY, WITH_IMAGE])
    ]
    return [r.hidden_states.numpy() for r in e.generate(prompts, timeout_s=DEADLINE_S)]  # pickled by value


@pytest.mark.slow
def test_tp2_gives_the_direct_forward_states(tiny_ckpt, want):
    cfg = EngineConfig(block_size=16, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64)
    states = run_tp2(functools.partial(_tp_states, str(tiny_ckpt)), tiny_ckpt, cfg, DEADLINE_S)
    for got, expected in zip(states, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-4, atol=1e-4)
