"""The decode attention's tiles read before its PDL wait (`paged_attention.DecodeTiles`): any number
of them gives the default's bits (one tile), in every mode of the launch, at contexts ending in
each tile and on its boundaries, with and without splits; no row another kernel writes is read
before the wait; bench/attention_decode_gpu.py --preload's CPU parts (its GPU timing aside)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from omnistage.services.thinker.kernels import paged_attention
from omnistage.services.thinker.kernels.paged_attention import (
    DECODE_TILES,
    FEW_SEQS,
    FEW_SEQS_TILES,
    MAX_PRELOAD_TILES,
    DecodeTiles,
    default_tiles,
    paged_decode,
)
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "bench"))
import attention_decode_gpu as bench  # noqa: E402

PAGE, DIM = 16, 32
# Tiles of 64 positions (BLOCK_N at pages of 16): a context ending in the first tile, on its last
# row, one past it (the new row the second tile's first), in and at the end of the second, third
# and fourth, past the fourth (read after the wait whatever the preload); 1 (the new row alone),
# page boundaries; a padding row of a decode graph (context 0, slot -1). With splits of at least
# 128 positions the new row falls in a later split's first or second tile too (300 at 2 splits:
# 192 … 299; at 8: 256 … 299, 257 at 2: 192 … 256, at 8: 256 alone).
CONTEXTS = [1, 2, 15, 16, 17, 63, 64, 65, 100, 127, 128, 129, 191, 192, 193, 255, 256, 257, 300, 0]
MODES = ("cached", "write_kv", "qk_rope")


class Launch:
    """One decode launch of CONTEXTS (8 query heads, 2 KV heads): caches, block tables, q, the new
    tokens' K/V and slots (each context's last position), QK-norm weights and rope."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        torch.manual_seed(seed)
        pages = [max(1, -(-c // PAGE)) for c in CONTEXTS]
        blocks = sum(pages) + 2
        self.caches = torch.randn(2, blocks, PAGE, 2, DIM).to(dtype).unbind(0)
        free = torch.randperm(blocks).tolist()
        self.tables = torch.full((len(pages), max(pages)), -1, dtype=torch.int64)
        for b, n in enumerate(pages):
            self.tables[b, :n] = torch.tensor([free.pop() for _ in range(n)])
        last = [int(self.tables[b, (c - 1) // PAGE]) * PAGE + (c - 1) % PAGE for b, c in enumerate(CONTEXTS)]
        self.slots = torch.tensor([s if c > 0 else -1 for s, c in zip(last, CONTEXTS, strict=True)])
        self.lens = torch.tensor(CONTEXTS)
        self.q = torch.randn(len(pages), 8, DIM).to(dtype)
        self.k, self.v = torch.randn(2, len(pages), 2, DIM).to(dtype).unbind(0)
        positions = torch.tensor([max(c - 1, 0) for c in CONTEXTS])
        cos, sin = RotaryEmbedding(DIM, DIM // 2, 1e6, "default").cos_sin(positions, dtype)
        weights = torch.randn(2, DIM).to(dtype)
        self.qk_rope = (weights[0], weights[1], 1e-6, cos, sin)

    def decode(self, splits: int, mode: str, tiles: DecodeTiles | None = None, caches=None) -> tuple:
        """paged_decode in `mode` at `tiles` on `caches` (copies of this launch's unless given) →
        (output, K cache, V cache)."""
        k_cache, v_cache = caches or (c.clone() for c in self.caches)
        new_kv = (self.k, self.v, self.slots) if mode != "cached" else None
        qk_rope = self.qk_rope if mode == "qk_rope" else None
        args = (self.q, k_cache, v_cache, self.tables, self.lens, DIM**-0.5)
        return paged_decode(*args, new_kv, splits, qk_rope, tiles), k_cache, v_cache


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# Every (splits, mode) in bf16, the model's dtype; fp32 where the most runs at once (8 splits, the new
# row written and QK-normed + roped): the tiles' loads do not depend on the dtype (CI time, interpreter).
PRELOAD_CASES = [(s, m, torch.bfloat16) for s in (1, 2, 8) for m in MODES] + [(8, "qk_rope", torch.float32)]


@pytest.mark.parametrize(
    "splits, mode, dtype", PRELOAD_CASES, ids=[f"{s}-{m}-{str(d)[6:]}" for s, m, d in PRELOAD_CASES]
)
def test_tiles_read_before_the_wait_change_no_bit(splits, mode, dtype):
    """2, 3 and 4 tiles read before the wait: the output and the caches the default's (one tile) bit
    for bit, at every context; a tile before the wait past the split's end reads nothing."""
    launch = Launch(dtype)
    want = [bits(t) for t in launch.decode(splits, mode)]
    assert DECODE_TILES == DecodeTiles(1, 4)
    for preload in range(2, MAX_PRELOAD_TILES + 1):
        got = launch.decode(splits, mode, DecodeTiles(preload))
        for name, a, b in zip(("output", "k_cache", "v_cache"), got, want, strict=True):
            assert torch.equal(bits(a), b), (preload, name)


@pytest.mark.parametrize("splits", [2, 8])
def test_a_splits_fewest_tokens_moves_the_merge_and_keeps_the_attention(splits):
    """`min_chunk` (a split's fewest tokens; OMNISTAGE_THINKER_DECODE_TILES=P,W,M): at 256 a context
    up to 256 runs in split 0 alone and longer ones in fewer, larger splits — the fp32 output the
    default's within rounding at every context (other splits sum other rows), the caches bit for
    bit, with tiles before the wait too."""
    launch = Launch(torch.float32, seed=2)
    want = launch.decode(splits, "write_kv")
    for tiles in (DecodeTiles(1, 4, 256), DecodeTiles(4, 4, 256), DecodeTiles(2, 4, 64)):
        got = launch.decode(splits, "write_kv", tiles)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(bits(got[1]), bits(want[1])) and torch.equal(bits(got[2]), bits(want[2]))
        if tiles.min_chunk == 256:  # the launch took it: contexts past 128 are summed in other splits
            assert not torch.equal(bits(got[0]), bits(want[0]))


@pytest.mark.parametrize("mode", ["cached", "write_kv"])
@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("preload", [1, 2, 4])
def test_no_row_this_step_writes_is_read_before_the_wait(preload, splits, mode, monkeypatch):
    """The kernel before (cached: the new row's own launch) completes only at the wait: every
    program starts with each context's new row NaN in the caches (the interpreter runs the programs
    one after another) and, cached, sees it written at its wait; with write_kv the launch writes it
    itself after the wait. A load before the wait of a row another kernel writes, kept, would reach
    the output as NaN; the outputs are the default's (one tile) with the caches holding the rows
    all along, bit for bit."""
    launch = Launch(torch.float32, seed=1)
    k_cache, v_cache = (c.clone() for c in launch.caches)
    live = launch.slots >= 0
    slots, new_k, new_v = launch.slots[live], launch.k[live], launch.v[live]
    rows_k, rows_v = k_cache.view(-1, 2, DIM), v_cache.view(-1, 2, DIM)  # a row a slot
    rows_k[slots], rows_v[slots] = new_k, new_v
    want, _, _ = launch.decode(splits, mode, DECODE_TILES, (k_cache.clone(), v_cache.clone()))
    start, wait = paged_attention.split_range, paged_attention.wait_for_prior_kernels
    starts, waits = [], []

    def starting(*args):  # each program's first call, before any load of the caches
        rows_k[slots], rows_v[slots] = float("nan"), float("nan")
        starts.append(1)
        return start(*args)

    def waiting(use_pdl):
        if mode == "cached":
            rows_k[slots], rows_v[slots] = new_k, new_v
        waits.append(1)
        return wait(use_pdl)

    monkeypatch.setattr(paged_attention, "split_range", starting)
    monkeypatch.setattr(paged_attention, "wait_for_prior_kernels", waiting)
    got, _, _ = launch.decode(splits, mode, DecodeTiles(preload), (k_cache, v_cache))
    assert len(starts) == len(waits) == len(CONTEXTS) * 2 * splits  # every program poisoned, then waited
    assert not got.isnan().any() and torch.equal(bits(got), bits(want))


def test_decode_tiles_are_checked_and_launch_as_given():
    assert DecodeTiles().launch(16) == dict(
        BLOCK_N=64, PRELOAD_TILES=1, MIN_CHUNK=128, num_warps=4, num_stages=2
    )
    assert DecodeTiles(4, 8, 256).launch(128) == dict(
        BLOCK_N=128, PRELOAD_TILES=4, MIN_CHUNK=256, num_warps=8, num_stages=2
    )
    bad_ones = (dict(preload_tiles=0), dict(preload_tiles=MAX_PRELOAD_TILES + 1), dict(warps=3))
    for bad in (*bad_ones, dict(min_chunk=0), dict(min_chunk=100)):
        with pytest.raises(ValueError, match="DecodeTiles"):
            DecodeTiles(**bad)


def test_a_launch_of_few_sequences_takes_eight_warps_by_default_and_more_take_four():
    """The measured rule (bench/RESULTS.md 2026-11-30): 8 warps at up to FEW_SEQS sequences (one
    sequence's launch 4.57-6.23 µs against 4.94-6.52), the 4-warp default beyond; tiles given win."""
    assert FEW_SEQS == 2
    assert [default_tiles(b) for b in (1, 2)] == [FEW_SEQS_TILES] * 2 == [DecodeTiles(1, 8)] * 2
    assert [default_tiles(b) for b in (3, 8, 64)] == [DECODE_TILES] * 3
    seen = []
    launch = Launch(torch.float32)
    original = paged_attention.DecodeTiles.launch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            paged_attention.DecodeTiles,
            "launch",
            lambda self, page: seen.append(self) or original(self, page),
        )
        launch.decode(1, "cached")
        launch.decode(1, "cached", DecodeTiles(2, 4))
    assert seen == [default_tiles(len(CONTEXTS)), DecodeTiles(2, 4)]


def test_the_preload_bench_sweeps_tiles_by_warps_and_fails_on_changed_bits():
    args = bench.parse_args(["--preload"])
    assert args.seqs == [1, 8] and args.contexts == [64, 128, 192, 256, 512]
    names = [bench.variant_name(t) for t in args.variants]
    assert names == ["p1w4", "p2w4", "p4w4", "p1w8", "p2w8", "p4w8"]  # the default first
    assert [bench.variant_name(t) for t in bench.parse_args(["--preload-tiles", "2"]).variants] == [
        "p1w4",
        "p2w4",
        "p1w8",
        "p2w8",
    ]
    swept = bench.parse_args(["--preload-tiles", "2", "--preload-warps", "4", "--min-chunks", "128,256"])
    assert [bench.variant_name(t) for t in swept.variants] == ["p1w4", "p2w4", "p1w4m256", "p2w4m256"]
    out = torch.randn(1, 16, 128).to(torch.bfloat16)
    cache = torch.randn(4, 16).to(torch.bfloat16)
    nudged = out.clone()
    nudged.view(torch.int16)[0, 0, 0] ^= 1  # one bit of one element: a rounding apart
    variants = bench.preload_variants([2], [4, 8])
    same = {t: (out, cache, cache) for t in variants}
    found = bench.preload_bits(same)
    assert all(b["equal_default"] and b["equal_same_warps"] for b in found.values())
    row = dict(seqs=1, context=64, bits=found)
    assert bench.preload_failures([row]) == []
    # other warps, other roundings: reported, not failed; a preload changing a bit: failed
    warps8 = {t: (nudged if t.warps == 8 else out, cache, cache) for t in variants}
    found = bench.preload_bits(warps8)
    assert not found["p2w8"]["equal_default"] and found["p2w8"]["equal_same_warps"]
    assert bench.preload_failures([dict(row, bits=found)]) == []
    changed = {t: (nudged if t == DecodeTiles(2, 8) else out, cache, cache) for t in variants}
    assert bench.preload_failures([dict(row, bits=bench.preload_bits(changed))]) == ["seqs=1 ctx=64 p2w8"]
    far = {t: (out + 1 if t == DecodeTiles(1, 8) else out, cache, cache) for t in variants}
    assert "seqs=1 ctx=64 p1w8" in bench.preload_failures([dict(row, bits=bench.preload_bits(far))])


@pytest.mark.slow
def test_the_preload_bench_case_runs_under_the_interpreter(monkeypatch):
    """One --preload case at Ling-mini's shape on the CPU (a stub for the GPU's graph timer): every
    variant run, equal to the default bit for bit (the interpreter has no warps)."""
    monkeypatch.setattr(bench, "CALLS", 2)
    timed = []
    variants = bench.preload_variants([2, 4], [4, 8])
    row = bench.bench_preload_case(
        "ling-mini tp1",
        bench.SHAPES["ling-mini tp1"],
        1,
        192,
        variants,
        lambda calls: timed.append(calls) or 1.0,
        "cpu",
    )
    assert len(timed) == len(variants) and all(len(calls) == 2 for calls in timed)
    assert row["decode_splits"] == 16 and not row["qk_rope_folded"] and row["fastest"] == "p1w4"
    assert all(b["equal_default"] for b in row["bits"].values()) and bench.preload_summary([row]) == 0
