"""The one-shot peer all-reduce kernel under the interpreter, in fp32 (CI has no GPU).

Ranks are processes sharing file-backed blocks (what CUDA IPC gives GPU processes), each summing
through the real kernel and `PeerAllReduce`: every rank's result is bit-equal to the rank-order fp32
sum, whatever the message's length and whichever half of the blocks a call uses. A rank whose peer
never comes stops after its poll bound, names the peer, and later calls wait for no one.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from omnistage.services.thinker.tp.peer_allreduce import PeerAllReduce, PeerAllReduceStalled, block_bytes
from omnistage.services.thinker.tp.peer_blocks import PeerBlocks

from tests.services.thinker.group.local_ranks import join_workers

CAPACITY = 4096  # bytes: 1024 fp32
SIZES = (1000, 37, 1024, 5)  # calls 1..4: both halves twice, ragged and full lengths
PROGRAMS = 2


def message(rank: int, call: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + call))


def rank_order_sum(world: int, call: int, n: int) -> torch.Tensor:
    acc = torch.zeros(n)
    for r in range(world):
        acc += message(r, call, n)
    return acc


def reducer_for(
    rank: int, blocks: list[torch.Tensor], max_polls: int, programs: int = PROGRAMS
) -> PeerAllReduce:
    return PeerAllReduce(
        PeerBlocks(rank, blocks), torch.device("cpu"), 1.0, CAPACITY, programs, max_polls=max_polls
    )


def rank_main(rank: int, paths: list[str], out: str) -> None:
    """One rank: map every rank's block file (its own too), sum SIZES' messages, save the results."""
    nbytes = block_bytes(CAPACITY)
    blocks = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in paths]
    reducer = reducer_for(rank, blocks, max_polls=1 << 40)
    results = []
    for call, n in enumerate(SIZES):
        x = message(rank, call, n)
        assert reducer.takes(x)
        results.append(reducer(x).clone())
    reducer.check()
    torch.save(results, out)


@pytest.mark.parametrize("world", [3])
def test_every_rank_gets_the_rank_order_fp32_sum(tmp_path: Path, world: int):
    paths = []
    for r in range(world):
        path = tmp_path / f"block{r}"
        path.write_bytes(bytes(block_bytes(CAPACITY)))
        paths.append(str(path))
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=rank_main, args=(r, paths, str(tmp_path / f"out{r}.pt")), name=f"rank{r}")
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    assert join_workers(procs, timeout_s=600) == [0] * world
    for r in range(world):
        results = torch.load(tmp_path / f"out{r}.pt")
        for call, n in enumerate(SIZES):
            assert torch.equal(results[call], rank_order_sum(world, call, n)), (r, call, n)


def test_a_rank_that_comes_late_still_gets_the_sum_from_a_peer_that_gave_up():
    """Rank 1 announces its call, waits past its poll bound (rank 0 has not come) and names rank 0;
    rank 0 then finds rank 1's announcement and its slice, and sums."""
    blocks = [torch.zeros(block_bytes(CAPACITY), dtype=torch.uint8) for _ in range(2)]
    # One program each: rank 1's failed wait stops its later programs from announcing.
    late, early = reducer_for(0, blocks, 3, programs=1), reducer_for(1, blocks, 3, programs=1)
    x1, x0 = message(1, 0, 300), message(0, 0, 300)
    early(x1)
    with pytest.raises(PeerAllReduceStalled, match="call 1 waited 1s for rank 0") as stalled:
        early.check()
    assert stalled.value.culprit_rank == 0
    late(x0)
    late.check()
    assert torch.equal(x0, rank_order_sum(2, 0, 300))


def test_a_wait_past_its_bound_names_the_peer_and_later_calls_wait_for_no_one():
    blocks = [torch.zeros(block_bytes(CAPACITY), dtype=torch.uint8) for _ in range(2)]
    alone = reducer_for(0, blocks, max_polls=3)
    x = message(0, 0, 64)
    mine = x.clone()
    alone(x)
    assert torch.equal(x, mine)  # no sum without the peer: the message is left as it was
    with pytest.raises(PeerAllReduceStalled) as stalled:
        alone.check()
    assert stalled.value.culprit_rank == 1 and "call 1 " in str(stalled.value)
    peer_flags = blocks[1][:8].view(torch.int64)  # program 0's flag for rank 0 in rank 1's block
    assert int(peer_flags[0]) == 1
    alone(x)  # the group failed: no announcement, no wait, the first error kept
    assert int(peer_flags[0]) == 1
    with pytest.raises(PeerAllReduceStalled, match="call 1 "):
        alone.check()
