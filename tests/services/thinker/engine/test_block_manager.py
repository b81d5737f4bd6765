from __future__ import annotations

import pytest
from omnistage.services.thinker.engine.block_manager import BlockManager
from omnistage.services.thinker.engine.sequence import SamplingParams, Sequence


def seq(n: int, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams(), max_tokens=8)


def test_allocate_rounds_up_to_blocks_and_appends_only_when_a_block_fills():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(9)
    assert bm.num_blocks_needed(s, 9) == 3
    bm.allocate(s, 9)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    s.num_computed_tokens = 9
    assert bm.num_blocks_needed(s, 3) == 0  # slots 9..11 live in the third block
    assert bm.num_blocks_needed(s, 4) == 1
    bm.allocate(s, 4)
    assert len(s.block_table) == 4 and len(set(s.block_table)) == 4
    assert bm.slot(s, 9) == s.block_table[2] * 4 + 1


def test_free_returns_every_block_and_resets_progress():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = seq(8, "a"), seq(5, "b")
    bm.allocate(a, 8)
    bm.allocate(b, 5)
    assert bm.num_free_blocks == 2
    a.num_computed_tokens = 8
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0 and bm.num_free_blocks == 4
    bm.free(b)
    assert bm.num_free_blocks == 6 and sorted(bm.free_block_ids) == list(range(6))
    assert all(r == 0 for r in bm.ref_counts)


def test_shared_blocks_are_released_only_by_the_last_owner():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = seq(8, "a"), seq(8, "b")
    bm.allocate(a, 8)
    bm.share(b, a.block_table[:1])
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.free(a)
    assert bm.num_free_blocks == 3  # the shared block is still held by b
    bm.free(b)
    assert bm.num_free_blocks == 4


def test_over_allocation_is_refused_not_corrupting():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(12)
    assert not bm.can_allocate(s, 12)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        bm.allocate(s, 12)
    assert bm.num_free_blocks == 2 and s.block_table == []
