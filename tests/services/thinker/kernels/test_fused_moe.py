"""The fused MoE (the pairs laid out by expert, two GEMM launches, the sum over each token's experts with
the shared expert's add) equals the reference expert loop, fused or not."""

from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.kernels import fused_moe, moe_align
from omnistage.services.thinker.kernels.fused_moe import GemmTiles, MoeTiles, choose_tiles, fused_experts
from omnistage.services.thinker.kernels.moe_align import COUNT_SPAN, align_by_expert
from omnistage.services.thinker.models.layers.moe import FusedExperts, GatedMLP
from omnistage.services.thinker.models.layers.parallel import TPGroup


def experts(num: int, hidden: int, inter: int, seed: int) -> FusedExperts:
    torch.manual_seed(seed)
    m = FusedExperts(num, hidden, inter, TPGroup())
    m.w13.data.normal_(0, 0.1)
    m.w2.data.normal_(0, 0.1)
    return m


def shared_expert(hidden: int, inter: int) -> GatedMLP:
    mlp = GatedMLP(hidden, inter, TPGroup(), reduce=False)
    mlp.gate_up_proj.weight.data.normal_(0, 0.1)
    mlp.down_proj.weight.data.normal_(0, 0.1)
    return mlp


@pytest.mark.parametrize(
    "num_experts,hidden,inter,top_k,tokens,hot",
    [
        (16, 64, 48, 4, 1, 16),  # one decode token: every block mostly padding
        (16, 64, 32, 4, 40, 5),  # 5 hot experts: runs longer than a block, several blocks each
        (32, 32, 32, 2, 70, 32),  # medium tiles (more rows per expert)
        (8, 48, 16, 2, 9, 8),  # widths that are not multiples of the tiles
    ],
)
def test_fused_experts_equal_the_reference_loop(num_experts, hidden, inter, top_k, tokens, hot):
    m = experts(num_experts, hidden, inter, seed=tokens)
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(hot)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    # The shared expert an expert's shape (folded in when fused) and twice it (never folded).
    for shared in (None, shared_expert(hidden, inter), shared_expert(hidden, 2 * inter)):
        want = m(x, weights, ids, shared)
        pair = None if shared is None else (shared.gate_up_proj.weight, shared.down_proj.weight)
        for fuse in (True, False):
            got = fused_experts(x, m.w13, m.w2, weights, ids, pair, fuse=fuse)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert ((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize(
    "tokens,fuse",
    [(20, True), (60, True), (20, False), (700, True)],
    ids=["one-program", "one-program-several-chunks", "one-counting-program", "several-counting-programs"],
)
def test_alignment_puts_every_pair_once_in_its_experts_block_padded_run(tokens, fuse, monkeypatch):
    monkeypatch.setattr(moe_align, "ONE_PROGRAM_MAX_PAIRS", 128)  # 60 tokens: one program's chunks
    one_program_max = moe_align.ONE_PROGRAM_MAX_PAIRS
    torch.manual_seed(0)
    num_experts, block_m = 16, 16
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)])  # pairs over 4 experts
    assert tokens * 2 <= COUNT_SPAN or tokens * 2 > 2 * COUNT_SPAN  # 700 tokens: 1400 pairs, 3 programs
    assert (tokens * 2 <= one_program_max) == (tokens < 700)
    pairs, counts, ends, num_rows = align_by_expert(ids, num_experts, block_m, fuse)
    flat = ids.flatten()
    assert counts.tolist() == torch.bincount(flat, minlength=num_experts).tolist()
    padded = (counts + block_m - 1) // block_m * block_m
    assert ends.tolist() == padded.cumsum(0).tolist() and int(num_rows) == int(ends[-1])
    seen = []
    for e in range(num_experts):
        start = int(ends[e] - padded[e])
        assert start % block_m == 0
        run = pairs[start : start + int(counts[e])].tolist()
        assert all(int(flat[p]) == e for p in run)
        if fuse and tokens * 2 <= one_program_max:
            assert run == sorted(run)  # one program places the pairs in order
        seen += run
    assert sorted(seen) == list(range(flat.numel()))


def test_the_shared_run_follows_the_routed_runs_with_a_pair_per_token():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])
    pairs, counts, ends, num_rows = align_by_expert(ids, 4, 4, shared_rows=3)
    assert counts.tolist() == [1, 2, 1, 2, 3] and ends.tolist() == [4, 8, 12, 16, 20]
    assert int(num_rows) == 20 and pairs[16:19].tolist() == [6, 7, 8]  # pairs T*k + token
    assert pairs[4:6].tolist() == [1, 2] and pairs[12:14].tolist() == [0, 4]


@pytest.mark.parametrize("tokens", [3, 40, 300])
def test_both_layouts_append_the_same_shared_run(tokens, monkeypatch):
    """The multi-launch layout (zero fill, count, runs, scatter) with a shared run equals the one
    program's: the same counts, ends and rows in use, each run the same set of pairs (the atomic
    scatter may order a run otherwise), the shared run's pairs T*k + token."""
    torch.manual_seed(tokens)
    num_experts, block_m, k = 16, 4, 2
    ids = torch.stack([torch.randperm(6)[:k] for _ in range(tokens)])
    layouts = []
    for limit in (10**6, 0):  # one program, then the multi-launch layout
        monkeypatch.setattr(moe_align, "ONE_PROGRAM_MAX_PAIRS", limit)
        layouts.append(align_by_expert(ids, num_experts, block_m, True, tokens))
    one, multi = layouts
    for got, want in zip(multi[1:], one[1:], strict=True):
        assert got.tolist() == want.tolist()
    counts, ends = one[1], one[2]
    assert counts.numel() == num_experts + 1 and int(counts[-1]) == tokens
    padded = (counts + block_m - 1) // block_m * block_m
    for e in range(num_experts + 1):
        start = int(ends[e] - padded[e])
        runs = [sorted(layout[0][start : start + int(counts[e])].tolist()) for layout in (multi, one)]
        assert runs[0] == runs[1]
    start = int(ends[-1] - padded[-1])
    assert multi[0][start : start + tokens].tolist() == list(range(tokens * k, tokens * k + tokens))


@pytest.mark.parametrize("tokens", [5, 38])  # top-8: 40 and 304 pairs, both past one program
def test_the_shared_expert_folds_in_with_the_multi_launch_layout(tokens, monkeypatch):
    m = experts(16, 64, 32, seed=tokens)
    shared = shared_expert(64, 32)
    x = torch.randn(tokens, 64)
    ids = torch.stack([torch.randperm(16)[:8] for _ in range(tokens)])
    weights = torch.rand(tokens, 8)
    unfolded = []
    monkeypatch.setattr(fused_moe, "_shared_expert", lambda *a: unfolded.append(a) or None)
    got = fused_experts(x, m.w13, m.w2, weights, ids, (shared.gate_up_proj.weight, shared.down_proj.weight))
    assert not moe_align.one_program(tokens * 8, True) and unfolded == []  # folded: no GEMMs of its own
    want = m(x, weights, ids, shared)
    assert ((got - want).norm() / want.norm()) < 1e-5


def test_tiles_grow_with_the_rows_each_expert_gets():
    small, medium, large = choose_tiles(8, 256), choose_tiles(8 * 1024, 256), choose_tiles(8 * 4096, 256)
    assert small.block_m < medium.block_m < large.block_m


def test_a_measured_table_entry_sets_each_gemms_tiles_and_the_rule_covers_the_rest(monkeypatch):
    """TILES keyed by (experts, intermediate, hidden, pairs bucket): the gate-up and the down GEMM
    launch with their own entry's tiles, and the result is still the reference's."""
    measured = MoeTiles(32, GemmTiles(16, 32, 4, 2), GemmTiles(64, 16, 2, 3))
    monkeypatch.setitem(fused_moe.TILES, (16, 48, 64, 16), measured)  # 3 tokens x top-4: 12 pairs -> 16
    assert choose_tiles(12, 16, 48, 64) is measured
    assert choose_tiles(12, 16, 48, 128) == choose_tiles(12, 16) == fused_moe.rule_tiles(12, 16)
    assert choose_tiles(17, 16, 48, 64) == fused_moe.rule_tiles(17, 16)  # the next bucket: unmeasured
    launches = []
    real = fused_moe.gemm_meta

    def spy(block_m, tiles, num_experts, dtype):
        launches.append((block_m, tiles))
        return real(block_m, tiles, num_experts, dtype)

    monkeypatch.setattr(fused_moe, "gemm_meta", spy)
    m = experts(16, 64, 48, seed=5)
    x, weights = torch.randn(3, 64), torch.rand(3, 4)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(3)])
    shared = shared_expert(64, 48)
    want = m(x, weights, ids, shared)
    got = fused_experts(x, m.w13, m.w2, weights, ids, (shared.gate_up_proj.weight, shared.down_proj.weight))
    assert launches == [(32, measured.gate_up), (32, measured.down)]
    assert ((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize(
    "fuse,codes,launched",
    [
        (True, None, ["_route_kernel"]),
        (True, "text", ["_route_kernel"]),  # every token text: one router runs
        (True, "every-router", ["_route_kernel"] * 3),
        (False, None, ["_route_kernel", "_count_kernel", "_runs_kernel", "_scatter_kernel"]),
    ],
    ids=["text-step", "one-code", "every-router", "fusions-off"],
)
def test_a_one_token_moe_step_needs_no_alignment_with_the_fusions_on(fuse, codes, launched, moe_launches):
    """A decode step at T=1 with the fusions on: the experts read the router's ids themselves
    (`moe_one_token`), so no alignment launch follows the router's, with one router or three on
    every token (a graph's multimodal step); with the fusions off the experts align the ids. Same
    output as the reference block."""
    from omnistage.services.thinker.models.layers.backends import Backends, install_backends
    from omnistage.services.thinker.models.layers.moe import RouterRows, SparseMoeBlock
    from omnistage.services.thinker.models.layers.parallel import TPGroup

    torch.manual_seed(7)
    block = SparseMoeBlock(64, 16, 32, 1, 4, 4, 2, 1.5, multi_router=True, tp=TPGroup())
    for p in block.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(1, 64)
    modality = {
        None: None,
        "text": RouterRows.of(torch.zeros(1, dtype=torch.long), 3),
        "every-router": RouterRows.every_router(torch.ones(1, dtype=torch.long)),
    }[codes]
    want = block(x, modality)
    install_backends(block, Backends("torch", "triton"), fuse=fuse)
    got = block(x, modality)
    assert moe_launches.names() == launched
    assert ((got - want).norm() / want.norm()) < 1e-5
