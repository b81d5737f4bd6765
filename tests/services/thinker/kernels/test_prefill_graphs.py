"""The prefill-graph runner without a GPU: which steps it covers, the staged buffers (padding tokens
write no slot and sit in no tile, the tile table padded with empty tiles, the sample rows padded
with row 0), placeholders filled on the device; the paged prefill kernel over a padded table; and
the tiny engine on the Triton kernels with its prefill and mixed steps through the buffers (no
capture) gives the reference engine's greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch
from omnistage.common.config import ConfigError, EngineConfig
from omnistage.services.thinker.engine.prefill_graphs import (
    PrefillGraphs,
    max_tiles,
    prefill_graph_reserve_bytes,
)
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.kernels.tile_table import prefill_tile_rows
from omnistage.services.thinker.tp.plan import StepPlan


class Recorder(torch.nn.Module):
    """A stand-in model that records the static rows and metadata the runner hands it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def forward(self, ids, positions, modality=None, media_index=None, media_rows=None):
        from omnistage.services.thinker.models.layers.attention import current_metadata

        md = current_metadata(ids.shape[0])
        self.calls.append(
            dict(
                media=None
                if media_index is None
                else (modality.codes.clone(), media_index.clone(), media_rows.clone()),
                ids=ids.clone(),
                pos=positions.clone(),
                slots=md.slot_mapping.clone(),
                tables=md.block_tables.clone(),
                tiles=md.step_state["graph_tiles"].clone(),
                is_decode=md.is_decode,
                ptr=ids.data_ptr(),
            )
        )
        return ids.float()[:, None].expand(-1, 4)

    def compute_logits(self, hidden):
        return hidden * 2


def mixed_plan() -> StepPlan:
    """A decode row (sequence 0, context 9) beside a 5-token prompt chunk over 3 cached tokens."""
    return StepPlan(
        input_ids=torch.tensor([50, 60, 61, 62, 63, 64]),
        positions=torch.tensor([8, 3, 4, 5, 6, 7]).repeat(3, 1),
        query_lens=torch.tensor([1, 5]),
        context_lens=torch.tensor([9, 8]),
        slot_mapping=torch.tensor([40, 67, 68, 69, 70, 71]),
        block_tables=torch.tensor([[2, 0], [4, 5]]),
        sample_rows=torch.tensor([0, 5]),
    )


def graphs_for(model, sizes=(4, 8, 16), max_seqs=3, block_q=2) -> PrefillGraphs:
    return PrefillGraphs(
        model, sizes, max_seqs, max_blocks=3, block_q=block_q, device=torch.device("cpu"), capture=False
    )


def test_a_step_runs_at_its_token_bucket_with_padding_that_writes_and_reads_nothing():
    model = Recorder()
    graphs = graphs_for(model)
    logits = graphs.run(mixed_plan())
    call = model.calls[-1]
    assert call["ids"].tolist() == [50, 60, 61, 62, 63, 64, 0, 0]  # bucket 8: two padding tokens
    assert call["slots"].tolist() == [40, 67, 68, 69, 70, 71, -1, -1]
    assert call["pos"][:, :6].tolist() == [[8, 3, 4, 5, 6, 7]] * 3 and call["pos"][:, 6:].eq(0).all()
    assert call["tables"][:2, :2].tolist() == [[2, 0], [4, 5]]
    assert not call["is_decode"]  # the attention takes its prefill path, reading the staged table
    # the decode row is a tile of one token; the chunk's 5 tokens tiles of 2, 2, 1; the rest empty
    tiles = call["tiles"]
    assert tiles[:4].tolist() == [[0, 0, 1, 8, 9], [1, 1, 2, 3, 8], [1, 3, 2, 5, 8], [1, 5, 1, 7, 8]]
    assert tiles.shape[0] == max_tiles(16, 3, 2) and tiles[4:].eq(0).all()
    assert logits.tolist() == [[100.0] * 4, [128.0] * 4]  # rows 0 and 5 (ids 50 and 64) doubled


def test_buffers_are_reused_and_a_smaller_step_leaves_no_tile_or_slot_of_a_larger_one():
    model = Recorder()
    graphs = graphs_for(model)
    big = StepPlan(
        input_ids=torch.arange(100, 112),
        positions=torch.arange(12).repeat(3, 1),
        query_lens=torch.tensor([12]),
        context_lens=torch.tensor([12]),
        slot_mapping=torch.arange(12),
        block_tables=torch.tensor([[0, 1, 2]]),
        sample_rows=torch.tensor([11]),
    )
    graphs.run(big)  # bucket 16: six tiles
    graphs.run(mixed_plan())  # bucket 8
    first, second = model.calls
    assert first["ptr"] == second["ptr"] and len(first["ids"]) == 16 and len(second["ids"]) == 8
    assert second["tiles"][4:].eq(0).all()  # the larger step's last two tiles are gone
    assert second["slots"][6:].tolist() == [-1, -1]


def test_a_media_step_stages_its_rows_slots_and_router_codes_and_a_text_step_none():
    model = Recorder()
    graphs = graphs_for(model)
    plan = mixed_plan()  # the chunk's tokens 2-3 (rows 2, 3) are an audio item's
    plan.media_index = torch.tensor([2, 3])
    plan.media_modality = torch.tensor([2, 2])
    plan.media_rows = torch.tensor([[1.0], [2.0]])
    graphs.run(plan)
    codes, index, rows = model.calls[-1]["media"]
    assert codes.tolist() == [0, 0, 2, 2, 0, 0, 0, 0]  # every token's router: text but the audio rows
    assert index.tolist() == [2, 3] + [7] * 6  # the padding entries all on the last padding token
    assert rows.flatten().tolist() == [1.0, 2.0] + [0.0] * 6
    graphs.run(mixed_plan())
    assert model.calls[-1]["media"] is None  # a text step replays the text graph


def test_every_router_on_every_token_routes_as_the_split_by_code():
    from omnistage.services.thinker.models.layers.moe import RouterRows, SparseMoeBlock
    from omnistage.services.thinker.models.layers.parallel import TPGroup

    torch.manual_seed(0)
    block = SparseMoeBlock(32, 16, 8, 1, 4, 4, 2, 2.5, True, TPGroup())
    for name in block.router_names:
        getattr(block, name).weight.data.normal_(0, 0.5)
    x = torch.randn(12, 32)
    codes = torch.tensor([0, 1, 1, 2, 0, 2, 2, 1, 0, 0, 2, 1])
    want = block.route(x, codes)
    got = block.route(x, RouterRows.every_router(codes))
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0])
    text = block.route(x, RouterRows.every_router(torch.zeros(12, dtype=torch.long)))
    assert torch.equal(text[1], block.gate(x)[1])


def test_placeholders_take_the_shared_ids_on_the_device():
    from omnistage.services.thinker.engine.sampled_feed import SampledFeed
    from omnistage.services.thinker.models.layers.parallel import TPGroup

    model = Recorder()
    graphs = graphs_for(model)
    feed = SampledFeed(torch.device("cpu"), TPGroup())
    feed.share(StepPlan(sample_rows=torch.arange(1)), torch.tensor([77]))
    plan = mixed_plan()
    plan.input_ids = torch.tensor([-1, 60, 61, 62, 63, 64])  # the decode row's id: last step's sample
    graphs.run(plan, feed.fill)
    assert model.calls[-1]["ids"][:6].tolist() == [77, 60, 61, 62, 63, 64]
    assert plan.input_ids[0].item() == -1  # the host plan is left as it was


def test_only_steps_with_a_prompt_chunk_within_the_sizes_are_covered():
    graphs = graphs_for(Recorder())
    assert graphs.covers(mixed_plan())
    decode = StepPlan(
        input_ids=torch.tensor([1, 2]),
        positions=torch.zeros(3, 2, dtype=torch.int64),
        query_lens=torch.tensor([1, 1]),
        context_lens=torch.tensor([4, 5]),
        slot_mapping=torch.tensor([3, 20]),
        block_tables=torch.tensor([[0], [1]]),
        sample_rows=torch.tensor([0, 1]),
    )
    assert not graphs.covers(decode)  # DecodeGraphs' steps
    media = mixed_plan()
    media.media_index = torch.tensor([2, 3])
    assert graphs.covers(media) and graphs.size_for(media) == 8
    full = mixed_plan()  # 6 tokens: a text step fits size 6, a media step needs a padding row past them
    full.media_index = torch.tensor([2])
    assert graphs_for(Recorder(), sizes=(6,)).covers(mixed_plan())
    assert not graphs_for(Recorder(), sizes=(6,)).covers(full)
    hidden = mixed_plan()
    hidden.hidden_index = torch.tensor([5])
    assert not graphs.covers(hidden)
    wide = mixed_plan()
    wide.block_tables = torch.zeros(2, 4, dtype=torch.int64)
    assert not graphs.covers(wide)  # a block table wider than the buffers
    assert not graphs_for(Recorder(), sizes=(4,)).covers(mixed_plan())  # 6 tokens: above the largest
    assert not graphs_for(Recorder(), max_seqs=1).covers(mixed_plan())  # two sequences
    assert not graphs.covers(StepPlan.noop())
    captured = PrefillGraphs(Recorder(), (8,), 3, 3, 2, torch.device("cpu"), capture=True)
    assert not captured.covers(mixed_plan())  # captured mode: nothing until capture() ran


def test_sizes_config_and_reserve():
    with pytest.raises(ConfigError, match="prefill_graph_tokens"):
        EngineConfig(prefill_graph_tokens=(1, 64)).validate("engine")
    EngineConfig(prefill_graph_tokens=()).validate("engine")
    reserve = prefill_graph_reserve_bytes((64, 512), 8, 1000, 2, 256, 8)
    assert reserve > 2 * 8 * 1000 * 2 * 4 and prefill_graph_reserve_bytes((), 8, 1000, 2, 256, 8) == 0
    assert prefill_tile_rows([3], [5], 2) == [0, 0, 2, 2, 5, 0, 2, 1, 4, 5]


def test_paged_prefill_over_a_padded_table_equals_the_unpadded_one_and_zeroes_padding_rows():
    from omnistage.services.thinker.kernels.paged_prefill import paged_prefill, prefill_tiles

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, page = 4, 2, 16, 16
    k_cache = torch.randn(4, page, kv_heads, dim, generator=gen)
    v_cache = torch.randn(4, page, kv_heads, dim, generator=gen)
    tables = torch.tensor([[0, 1], [2, 3]])
    query_lens, context_lens = [1, 5], [9, 20]
    q = torch.randn(8, heads, dim, generator=gen)  # 6 real tokens, 2 padding
    tiles = prefill_tiles(query_lens, context_lens, 2)
    want = paged_prefill(q[:6], k_cache, v_cache, tables, tiles, 0.25)
    padded = torch.zeros(max_tiles(8, 2, 2), 5, dtype=torch.int32)
    padded[: tiles.shape[0]] = tiles
    got = paged_prefill(q, k_cache, v_cache, tables, padded, 0.25, zero_rows=True)
    torch.testing.assert_close(got[:6], want)
    assert got[6:].eq(0).all()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(0, 900) for _ in range(rng.randrange(3, 6))] for _ in range(3)]


# Chunked: at most 8 tokens a step, so the third prompt's tail shares a step with the first two's
# decodes (a mixed step through the buffers too).
ENGINE_CFG = dict(block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)


def test_tiny_engine_on_triton_kernels_through_prefill_graph_buffers_equals_the_reference(
    tiny_ckpt_2_layers, prompts
):
    from omnistage.services.thinker.kernels.paged_prefill import tile_tokens

    reference = rank0_engine(
        start_rank(RankConfig(str(tiny_ckpt_2_layers), EngineConfig(**ENGINE_CFG), warmup=False))
    )
    want = [r.token_ids for r in reference.generate(prompts, PARAMS)]
    fast = EngineConfig(attention_backend="triton", moe_backend="triton", **ENGINE_CFG)
    engine = rank0_engine(start_rank(RankConfig(str(tiny_ckpt_2_layers), fast, warmup=False)))
    runner = engine.runner
    layer = runner.model.attention_layers()[0]
    block_q = tile_tokens(layer.num_heads, layer.num_kv_heads)
    graphs = PrefillGraphs(
        runner.model, (4, 8), 4, runner.cfg.max_blocks_per_seq, block_q, runner.device, capture=False
    )
    runner.use_prefill_graphs(graphs)
    steps = []
    run = graphs.run
    graphs.run = lambda plan, fill=None: (steps.append(plan.query_lens.tolist()), run(plan, fill))[1]
    got = [r.token_ids for r in engine.generate(prompts, PARAMS)]
    assert got == want
    assert sum(map(len, prompts)) > 8 and len(steps) >= 2  # the chunked prefill went through the buffers
    assert any(1 in lens and max(lens) > 1 for lens in steps), steps  # a mixed step among them


# --- TP=2: every rank takes the same steps through the buffers, their collectives in step ----------------

TP_DEADLINE_S = 240


def _with_prefill_buffers(started):
    """The rank's runner replays covered steps through prefill-graph buffers (no capture on a CPU),
    counting them (rank 0 reports the count)."""
    from omnistage.services.thinker.kernels.paged_prefill import tile_tokens

    runner = started.runner
    layer = runner.model.attention_layers()[0]
    graphs = PrefillGraphs(
        runner.model,
        (4, 8),
        runner.cfg.max_num_seqs,
        runner.cfg.max_blocks_per_seq,
        tile_tokens(layer.num_heads, layer.num_kv_heads),
        runner.device,
        capture=False,
    )
    runs, run = [], graphs.run
    graphs.run = lambda plan, fill=None: (runs.append(plan.num_tokens), run(plan, fill))[1]
    graphs.runs = runs
    runner.use_prefill_graphs(graphs)
    return started


def _tp_worker(cfg) -> None:
    from omnistage.common.log import setup_logging
    from omnistage.services.thinker.group.worker import run_plan_loop

    from tests.services.thinker.group import local_ranks

    setup_logging("thinker", rank=cfg.rank)
    code = 1
    try:
        run_plan_loop(_with_prefill_buffers(start_rank(cfg)))
        code = 0
    finally:
        local_ranks.end_process(code)


def _tp_rank0(prompts, ckpt, engine_cfg, port, out) -> None:
    from omnistage.common.log import setup_logging

    from tests.services.thinker.engine.tp_run import TP
    from tests.services.thinker.group import local_ranks

    setup_logging("thinker", rank=0)
    cfg = RankConfig(ckpt, engine_cfg, tp=TP, world_size=2, dist_port=port, full_warmup=False)
    procs = local_ranks.spawn_workers(cfg, _tp_worker)

    def run():
        engine = rank0_engine(_with_prefill_buffers(start_rank(cfg)))
        tokens = [r.token_ids for r in engine.generate(prompts, PARAMS)]
        runs = list(engine.runner.prefill_graphs.runs)
        engine.shutdown()
        return (tokens, runs), local_ranks.join_workers(procs, local_ranks.EXIT_WAIT_S)

    local_ranks.report_outcome(out, run)


@pytest.mark.slow
def test_tp2_ranks_replay_the_same_prefill_steps_through_the_buffers_as_the_tp1_reference(
    tiny_ckpt_2_layers, prompts
):
    """Rank 0 and its worker decide alike which steps the buffers take (padded to the same size, so
    their row-parallel sums and the logits' vocab gather match): the tokens are the TP=1 reference's."""
    from tests.services.thinker.group import local_ranks

    reference = rank0_engine(
        start_rank(RankConfig(str(tiny_ckpt_2_layers), EngineConfig(**ENGINE_CFG), warmup=False))
    )
    want = [r.token_ids for r in reference.generate(prompts, PARAMS)]
    fast = EngineConfig(attention_backend="triton", moe_backend="triton", **ENGINE_CFG)
    args = (prompts, str(tiny_ckpt_2_layers), fast, local_ranks.free_port())
    status, result, detail = local_ranks.run_rank0(_tp_rank0, args, TP_DEADLINE_S)
    assert status == "ok", f"{result}\n{detail}"
    assert detail == [0], f"worker exit codes {detail}"
    tokens, runs = result
    assert tokens == want
    assert len(runs) >= 2 and all(n <= 8 for n in runs), runs  # the chunked prefill took the buffers


def _logits_per_step(engine) -> list[torch.Tensor]:
    """Record every step's logits (the rows that sample) as the runner returns them."""
    steps: list[torch.Tensor] = []
    run = engine.runner.execute_step

    def execute(plan):
        out = run(plan)
        steps.append(None if out.logits is None else out.logits.clone())
        return out

    engine.runner.execute_step = execute
    return steps


def test_tiny_engine_with_image_and_audio_prompts_through_the_buffers_equals_eager(tiny_ckpt_3_layers):
    """Media steps through the buffers (rows staged, every router on every token) and the eager
    decode steps beside them: every step's logits and tokens are the eager
    engine's on the same kernels (test_engine_media.py holds eager to the reference). Three layers: with
    one MoE layer and none after it, a media token's routing would reach no sampled row."""
    from omnistage.common.transport import TransportContext
    from omnistage.services.thinker.kernels.paged_prefill import tile_tokens
    from omnistage.services.thinker.models.config import ThinkerConfig
    from omnistage.services.thinker.multimodal import MediaInputs

    from tests.services.thinker.engine.mm_prompts import items, layout

    parts = [[("text", 4), ("image", (2, 3)), ("text", 3)], [("text", 2), ("audio", 9), ("text", 5)]]
    cfg = ThinkerConfig.from_checkpoint(tiny_ckpt_3_layers)
    inputs = MediaInputs(cfg, torch.float32, TransportContext())
    prompts = []
    for i, p in enumerate(parts):
        ids, media = layout(cfg, p, seed=i)
        prompts.append(inputs.build(ids, items(cfg, media)))
    inputs.close()
    engine_cfg = dict(block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=12)
    fast = EngineConfig(attention_backend="triton", moe_backend="triton", **engine_cfg)
    eager = rank0_engine(start_rank(RankConfig(str(tiny_ckpt_3_layers), fast, warmup=False)))
    eager_logits = _logits_per_step(eager)
    want = [r.token_ids for r in eager.generate(prompts, SHORT)]
    engine = rank0_engine(start_rank(RankConfig(str(tiny_ckpt_3_layers), fast, warmup=False)))
    runner = engine.runner
    layer = runner.model.attention_layers()[0]
    block_q = tile_tokens(layer.num_heads, layer.num_kv_heads)
    graphs = PrefillGraphs(
        runner.model, (8, 16), 4, runner.cfg.max_blocks_per_seq, block_q, runner.device, capture=False
    )
    runner.use_prefill_graphs(graphs)
    media_steps = []
    run = graphs.run
    graphs.run = lambda plan, fill=None: (media_steps.append(plan.num_media_rows), run(plan, fill))[1]
    graph_logits = _logits_per_step(engine)
    assert [r.token_ids for r in engine.generate(prompts, SHORT)] == want
    assert any(media_steps), media_steps  # some steps with encoder rows went through the buffers
    assert len(graph_logits) == len(eager_logits)
    for got, ref in zip(graph_logits, eager_logits, strict=True):
        assert (got is None) == (ref is None)
        if got is not None:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
