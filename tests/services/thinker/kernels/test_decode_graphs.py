"""The decode-graph runner's logic without a GPU: bucket choice, padding rows, static buffers reused
across steps, which steps it covers; and the tiny engine on the triton kernels through its buffers
(no capture) gives the reference engine's greedy tokens, with the fusions on (a decode step's
QK-norm + rope in its attention launch), and with the fusions off (in a launch of its own) and the
Triton GEMV on (test_gemv.py tests the kernel itself)."""

from __future__ import annotations

import random

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, graph_reserve_bytes
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.tp.plan import StepPlan


def test_batch_sizes_cover_every_batch_up_to_the_largest():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(64)
    assert (
        sizes[:4] == [1, 2, 4, 8]
        and sizes[-1] == 64
        and all(b - a <= 8 for a, b in zip(sizes, sizes[1:], strict=False))
    )
    assert graph_reserve_bytes(8, 1000, 1) > sum(graph_batch_sizes(8)) * 1000 * 4


class Recorder(torch.nn.Module):
    """A stand-in model that records what the runner hands it: the ids it embeds (placeholders
    resolved from `sampled`, as the thinker's embedding does) and the address of `sampled`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []
        self.sampled: list[int | None] = []

    def forward(self, ids, positions, sampled=None):
        from omnistage.services.thinker.models.layers.attention import current_metadata
        from omnistage.services.thinker.models.layers.embed_head import resolve_placeholders

        md = current_metadata(ids.shape[0])
        self.sampled.append(None if sampled is None else sampled.data_ptr())
        self.calls.append(
            (
                ids.clone() if sampled is None else resolve_placeholders(ids, sampled),
                positions.clone(),
                md.slot_mapping.clone(),
                md.context_lens_tensor.clone(),
                md.block_tables.clone(),
                ids.data_ptr(),
            )
        )
        return ids.float()[:, None].expand(-1, 4)

    def compute_logits(self, hidden):
        return hidden * 2


def decode_plan(n: int, width: int = 3) -> StepPlan:
    return StepPlan(
        input_ids=torch.arange(100, 100 + n),
        positions=torch.arange(n).repeat(3, 1) + 7,
        query_lens=torch.ones(n, dtype=torch.int64),
        context_lens=torch.arange(n) + 8,
        slot_mapping=torch.arange(n) * 16 + 7,
        block_tables=torch.arange(n * width).view(n, width),
        sample_rows=torch.arange(n),
    )


def test_a_step_runs_at_its_bucket_with_padding_rows_that_write_and_read_nothing():
    model = Recorder()
    graphs = DecodeGraphs(model, max_batch=8, max_blocks=4, device=torch.device("cpu"), capture=False)
    logits = graphs.run(decode_plan(3))
    ids, pos, slots, ctx, tables, _ = model.calls[-1]
    assert ids.tolist() == [100, 101, 102, 0]  # bucket 4: one padding row
    assert slots.tolist() == [7, 23, 39, -1] and ctx.tolist() == [8, 9, 10, 0]
    assert pos[:, :3].tolist() == [[7, 8, 9]] * 3 and pos[:, 3].tolist() == [0, 0, 0]
    assert tables[:3, :3].tolist() == decode_plan(3).block_tables.tolist()
    assert logits.shape == (3, 4) and logits[:, 0].tolist() == [200.0, 202.0, 204.0]


def test_buffers_are_reused_and_a_smaller_step_clears_the_rows_a_larger_one_left():
    model = Recorder()
    graphs = DecodeGraphs(model, max_batch=8, max_blocks=4, device=torch.device("cpu"), capture=False)
    graphs.run(decode_plan(7))  # bucket 8: staging buffer 0
    graphs.run(decode_plan(1))  # bucket 1: buffer 1 (the step before read 0)
    graphs.run(decode_plan(2))  # bucket 2: buffer 0 again
    (ids8, *_, ptr8), (ids1, *_, ptr1), (ids2, _, slots2, ctx2, _, ptr2) = model.calls
    assert len(ids8) == 8 and len(ids1) == 1 and len(ids2) == 2
    assert ptr8 == ptr2 != ptr1  # two static buffers, sliced per bucket
    assert slots2.tolist() == [7, 23] and ctx2.tolist() == [8, 9]


def test_small_steps_take_the_two_staging_buffers_in_turn_and_larger_ones_the_first():
    """A step of one or two sequences is staged in the buffer the step before did not read (its copy
    then need not wait for that step, engine/decode_staging.py), so each has a graph per buffer; a
    larger step always reads the first buffer (one graph), and every step sees its own rows."""
    model = Recorder()
    graphs = DecodeGraphs(model, max_batch=8, max_blocks=4, device=torch.device("cpu"), capture=False)
    assert [graphs.buffers_of(s) for s in graph_batch_sizes(8)] == [(0, 1), (0, 1), (0,), (0,)]
    used = []
    for n in (1, 1, 2, 5, 1, 8, 2, 2):
        graphs.run(decode_plan(n))
        used.append(graphs.buffer)
        assert model.calls[-1][0][:n].tolist() == list(range(100, 100 + n))
    assert used == [1, 0, 1, 0, 1, 0, 1, 0]
    pointers = [call[-1] for call in model.calls]
    assert pointers[0] != pointers[1] and pointers[3] == pointers[5] == pointers[1]
    assert len(graphs.staging.buffers) == 2 and graphs.staging.copy_stream is None  # no copy stream on a CPU


def test_with_the_overlap_off_every_step_reads_one_staging_buffer(monkeypatch):
    """OMNISTAGE_THINKER_STAGE_OVERLAP=off (a same-build comparison): one buffer, one graph a size."""
    from omnistage.services.thinker.models.layers.backends import STAGE_OVERLAP_ENV

    monkeypatch.setenv(STAGE_OVERLAP_ENV, "off")
    model = Recorder()
    graphs = DecodeGraphs(model, max_batch=8, max_blocks=4, device=torch.device("cpu"), capture=False)
    assert len(graphs.staging.buffers) == 1 and graphs.buffers_of(1) == (0,)
    for n in (1, 1, 2):
        graphs.run(decode_plan(n))
        assert graphs.buffer == 0
    assert len({call[-1] for call in model.calls}) == 1


def test_placeholders_take_the_shared_ids_and_each_step_is_staged_beside_the_one_before():
    """Async scheduling: a plan's placeholder -r - 1 becomes the previous step's sampled id r on the
    device (the host plan is left as it was), and consecutive steps are staged in the two host
    arrays in turn (a step's copy may still be queued while the next is staged)."""
    from omnistage.services.thinker.engine.sampled_feed import SampledFeed
    from omnistage.services.thinker.models.layers.parallel import TPGroup

    model = Recorder()
    graphs = DecodeGraphs(model, max_batch=8, max_blocks=4, device=torch.device("cpu"), capture=False)
    feed = SampledFeed(torch.device("cpu"), TPGroup())
    feed.share(StepPlan(sample_rows=torch.arange(2)), torch.tensor([7, 9]))
    plan = decode_plan(3)
    plan.input_ids = torch.tensor([-2, 101, -1])
    assert plan.has_placeholders and not decode_plan(3).has_placeholders
    graphs.run(plan, feed.fill)
    assert model.calls[-1][0].tolist() == [9, 101, 7, 0]
    assert plan.input_ids.tolist() == [-2, 101, -1]
    graphs.run(decode_plan(2))
    assert model.calls[-1][0].tolist() == [100, 101]
    first, second = (graphs._views(h)[0][:3].tolist() for h in graphs.hosts)
    assert sorted([first, second]) == sorted([[-2, 101, -1], [100, 101, 0]])


def test_with_the_feed_the_forward_itself_takes_the_shared_ids():
    """Start-up's graphs read the sampled ids from the feed's fixed buffer inside the forward (what a
    captured graph replays): the staged row keeps its placeholder, the model gets it with the
    buffer (its embedding resolves it), a later share at the same address is what the next replay
    reads, and a plan naming ids before any step shared is refused on the host."""
    from omnistage.services.thinker.engine.sampled_feed import SampledFeed
    from omnistage.services.thinker.models.layers.parallel import TPGroup

    model = Recorder()
    feed = SampledFeed(torch.device("cpu"), TPGroup(), capacity=4)
    graphs = DecodeGraphs(
        model, max_batch=8, max_blocks=4, device=torch.device("cpu"), capture=False, feed=feed
    )
    plan = decode_plan(3)
    plan.input_ids = torch.tensor([-2, 101, -1])
    with pytest.raises(RuntimeError, match="no step shared any"):
        graphs.run(plan, feed.fill)
    buffer = feed.buffer.data_ptr()
    feed.share(StepPlan(sample_rows=torch.arange(2)), torch.tensor([7, 9]))
    graphs.run(plan, feed.fill)
    assert model.calls[-1][0].tolist() == [9, 101, 7, 0]
    assert graphs.ids[:3].tolist() == [-2, 101, -1]  # the staged row: resolved in the forward only
    feed.share(StepPlan(sample_rows=torch.arange(2)), torch.tensor([[11], [13]]))
    graphs.run(plan, feed.fill)
    assert model.calls[-1][0].tolist() == [13, 101, 11, 0] and feed.buffer.data_ptr() == buffer
    graphs.run(decode_plan(2))
    assert model.calls[-1][0].tolist() == [100, 101]
    assert model.sampled == [buffer] * 3  # every forward, placeholders or not: the graph is one
    with pytest.raises(RuntimeError, match="sampled 5 rows, more than the feed's 4"):
        feed.share(StepPlan(sample_rows=torch.arange(5)), torch.arange(5))


def test_only_pure_decode_steps_within_the_sizes_are_covered():
    graphs = DecodeGraphs(Recorder(), max_batch=4, max_blocks=4, device=torch.device("cpu"), capture=False)
    assert graphs.covers(decode_plan(4))
    assert not graphs.covers(decode_plan(5))  # more sequences than the largest graph
    assert not graphs.covers(decode_plan(2, width=5))  # a block table wider than the buffers
    prefill = decode_plan(2)
    prefill.query_lens = torch.tensor([1, 3])
    prefill.input_ids = torch.arange(4)
    assert not graphs.covers(prefill)
    hidden = decode_plan(2)
    hidden.hidden_index = torch.tensor([0])
    assert not graphs.covers(hidden)
    assert not graphs.covers(StepPlan.noop())
    captured = DecodeGraphs(Recorder(), max_batch=4, max_blocks=4, device=torch.device("cpu"), capture=True)
    assert not captured.covers(decode_plan(1))  # captured mode: nothing until capture() ran


@pytest.fixture(scope="module")
def prompts():
    """Three prompts of 3 to 5 tokens: one prefill step of at most 15 rows, within the GEMV's 16."""
    rng = random.Random(0)
    return [[rng.randrange(0, 900) for _ in range(rng.randrange(3, 6))] for _ in range(3)]


ENGINE_CFG = dict(block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_tokens(tiny_ckpt_2_layers, prompts):
    """The reference engine's (torch attention and MoE) greedy tokens, once for every case below
    (neither FUSIONS_ENV nor GEMV_ENV reaches the torch path); no warm-up: it proves nothing here."""
    cfg = RankConfig(str(tiny_ckpt_2_layers), EngineConfig(**ENGINE_CFG), warmup=False)
    reference = rank0_engine(start_rank(cfg))
    return [r.token_ids for r in reference.generate(prompts, PARAMS)]


# Each case is one interpreted engine run (its cost is the Triton interpreter's, one program at a time):
# on the tiny checkpoint's first two layers, the dense one and a MoE one, which run every kernel a
# step has (the other two MoE layers would only repeat the second's). Async scheduling with the
# graphs' feed (start-up's graphs): each decode step's ids are the step before's placeholders.
# `fusions-on` is the production path (GEMV off by default, the one-launch embedding on);
# `fusions-off-gemv-on` switches the diagnostic knobs in one run: with fusions off the shared expert
# is a GatedMLP of its own, so the GEMV reaches every projection (attention, dense and shared-expert
# MLPs, LM head), more than it would with fusions on; and the embedding's torch lookup resolves the
# placeholders (FUSED_EMBED_ENV off): both give the reference's tokens, so the same as each other.
@pytest.mark.parametrize(
    "fusions, gemv, embed",
    [("on", "off", "on"), ("off", "on", "off")],
    ids=["fusions-on", "fusions-off-gemv-on-embed-off"],
)
def test_tiny_engine_on_triton_kernels_through_graph_buffers_equals_the_reference(
    tiny_ckpt_2_layers, prompts, reference_tokens, fusions, gemv, embed, monkeypatch, launches, moe_launches
):
    from omnistage.services.thinker.kernels import embed_gather, fused_moe, norms, paged_attention
    from omnistage.services.thinker.kernels import gemv as gemv_kernels
    from omnistage.services.thinker.models.layers.backends import FUSED_EMBED_ENV, FUSIONS_ENV, GEMV_ENV

    monkeypatch.setenv(FUSIONS_ENV, fusions)
    monkeypatch.setenv(GEMV_ENV, gemv)
    monkeypatch.setenv(FUSED_EMBED_ENV, embed)
    folds = []  # whether each fused-path MoE call ran the shared expert as expert E
    foldable = fused_moe._foldable
    monkeypatch.setattr(fused_moe, "_foldable", lambda *a: folds.append(foldable(*a)) or folds[-1])
    rows = []  # the rows of each GEMV launch
    kernel = gemv_kernels.gemv
    monkeypatch.setattr(gemv_kernels, "gemv", lambda x, w: rows.append(x.shape[0]) or kernel(x, w))
    launches.watch(norms, "_qk_norm_rope_kernel")
    launches.watch(paged_attention, "_decode_kernel")
    launches.watch(embed_gather, "_embed_gather_kernel")
    # No warm-up: its largest shapes are slow in the interpreter and prove nothing here.
    fast = EngineConfig(attention_backend="triton", moe_backend="triton", async_scheduling="on", **ENGINE_CFG)
    engine = rank0_engine(start_rank(RankConfig(str(tiny_ckpt_2_layers), fast, warmup=False)))
    runner = engine.runner
    graphs = DecodeGraphs(
        runner.model, 4, runner.cfg.max_blocks_per_seq, runner.device, capture=False, feed=runner.feed
    )
    runner.use_graphs(graphs)
    sizes, placeholders, step_launches = [], [], []
    run = graphs.run

    def counted_run(plan, fill=None):
        sizes.append(int(plan.query_lens.numel()))
        placeholders.append(plan.has_placeholders)
        before = len(moe_launches.log)
        out = run(plan, fill)
        step_launches.append(moe_launches.names()[before:])
        return out

    graphs.run = counted_run
    got = [r.token_ids for r in engine.generate(prompts, PARAMS)]
    assert got == reference_tokens
    assert sizes == [3, 3]  # both decode steps went through the buffers (3 sequences, bucket 4)
    assert placeholders == [True, True]  # each ran ahead of the step before's ids reaching the host
    # on: the prefill's lookup, then each decode step's with the feed's buffer; off: the torch lookup
    fed = [args[1] is runner.feed.buffer for args in launches.arguments("_embed_gather_kernel")]
    assert fed == ([False, True, True] if embed == "on" else [])
    # QK-norm + rope: the prefill's in a launch of its own a layer (2 layers); each decode step's
    # (2 steps x 2 layers, bucket 4) in its attention launch (ROT > 0) with the fusions on, else
    # in a launch of its own before an attention launch without it.
    tokens = sum(map(len, prompts))
    qk_rows = [grid[0] for grid, _ in launches.of("_qk_norm_rope_kernel")]
    folded = [rot > 0 for _, rot in launches.of("_decode_kernel")]
    if fusions == "on":
        assert qk_rows == [tokens] * 2 and folded == [True] * 4
    else:
        assert qk_rows == [tokens] * 2 + [4] * 4 and folded == [False] * 4
    # on: a decode step's 16 pairs (bucket 4, top-4) laid out by one program after the router's
    # launch; off: the multi-launch layout (count, runs, scatter) in the MoE layer of each step
    fused = ["_route_kernel", "_align_one_program_kernel"]
    unfused = ["_route_kernel", "_count_kernel", "_runs_kernel", "_scatter_kernel"]
    assert step_launches == [fused if fusions == "on" else unfused] * 2
    # on: the prefill's few pairs and both decode steps fold the shared expert; off: never asked
    assert folds and all(folds) if fusions == "on" else folds == []
    if gemv == "on":  # the prefill's rows and both decode steps' (bucket 4) took the GEMV, nothing larger
        assert {sum(map(len, prompts)), 4} <= set(rows) <= set(range(1, 17)), rows
    else:  # off by default
        assert rows == []


def test_tp_groups_capture_aligned_unless_told_otherwise_and_an_unknown_mode_is_refused(monkeypatch):
    from omnistage.services.thinker.group.startup import TP_GRAPHS_ENV, tp_graph_capture

    monkeypatch.delenv(TP_GRAPHS_ENV, raising=False)
    assert tp_graph_capture() == "aligned"
    monkeypatch.setenv(TP_GRAPHS_ENV, " Off ")
    assert tp_graph_capture() == "off"
    monkeypatch.setenv(TP_GRAPHS_ENV, "yes")
    with pytest.raises(ValueError, match="expected off, aligned or unaligned"):
        tp_graph_capture()


def test_aligned_capture_agrees_on_each_size_and_a_rank_out_of_step_fails_naming_both_sizes():
    from omnistage.services.thinker.group.startup import RankStartup

    class Control:
        def __init__(self) -> None:
            self.asked: list[str] = []

        def agree_min(self, value: int, what: str) -> int:
            self.asked.append(what)
            return min(value, 8)  # a peer is at batch 8

    startup = RankStartup.__new__(RankStartup)
    startup.cfg, startup.control = RankConfig("unused", rank=1, world_size=2), Control()
    startup.tp_graphs = "aligned"
    align = startup.aligner("decode graph batch")
    align(8)
    with pytest.raises(RuntimeError, match="rank 1 captures decode graph batch 16 while a peer captures 8"):
        align(16)
    startup.aligner("prefill graph tokens")(8)
    assert startup.control.asked == [
        "capturing decode graph batch 8",
        "capturing decode graph batch 16",
        "capturing prefill graph tokens 8",
    ]
    startup.tp_graphs = "unaligned"
    assert startup.aligner("decode graph batch") is None
