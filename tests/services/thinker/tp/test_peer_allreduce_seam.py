"""The peer all-reduce behind `TPGroup.all_reduce`: the layers call one method and the messages the
peer path takes go to it, the rest to torch.distributed; its blocks live as long as the TP group;
a wait that timed out on the device fails the group at its next collective, naming the rank that
never came; the deploy knob."""

from __future__ import annotations

import pytest
import torch
from omnistage.common.config import ConfigError, EngineConfig, TPConfig
from omnistage.services.thinker.models.layers import parallel
from omnistage.services.thinker.models.layers.parallel import TPGroup
from omnistage.services.thinker.tp.distributed import TPControl, TPError
from omnistage.services.thinker.tp.peer_allreduce import (
    MAX_MESSAGE_BYTES,
    PeerAllReduce,
    PeerAllReduceStalled,
    block_bytes,
)
from omnistage.services.thinker.tp.peer_blocks import PeerBlocks


class Recording:
    """A SmallAllReduce that takes messages of at most `limit` elements and records them."""

    def __init__(self, limit: int) -> None:
        self.limit, self.summed = limit, []

    def takes(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.summed.append(x.numel())
        return x.mul_(2)


@pytest.fixture
def torch_sums(monkeypatch):
    summed: list[int] = []
    monkeypatch.setattr(parallel.dist, "all_reduce", lambda x: summed.append(x.numel()))
    return summed


def test_the_group_hands_small_messages_to_the_fast_sum_and_the_rest_to_torch(torch_sums):
    fast = Recording(limit=8)
    group = TPGroup(0, 2, fast)
    small, big = torch.ones(8), torch.ones(9)
    assert group.all_reduce(small) is small and torch.equal(small, torch.full((8,), 2.0))
    assert group.all_reduce(big) is big
    assert (fast.summed, torch_sums) == ([8], [9])
    assert TPGroup(0, 2, fast) == TPGroup(0, 2)  # the sum is not part of the group's identity


def test_one_rank_and_no_fast_sum_are_as_before(torch_sums):
    fast = Recording(limit=8)
    x = torch.ones(4)
    assert TPGroup(0, 1, fast).all_reduce(x) is x and fast.summed == [] and torch_sums == []
    TPGroup(1, 2).all_reduce(x)
    assert torch_sums == [4]


def cpu_reducer(rank: int = 0, world: int = 2) -> PeerAllReduce:
    blocks = PeerBlocks(rank, [torch.zeros(block_bytes(), dtype=torch.uint8) for _ in range(world)])
    return PeerAllReduce(blocks, torch.device("cpu"), timeout_s=120.0)


@pytest.mark.parametrize(
    ("x", "taken"),
    [
        (torch.ones(4096, dtype=torch.bfloat16), True),  # a decode step's message (hidden 4096)
        (torch.ones(MAX_MESSAGE_BYTES // 2, dtype=torch.bfloat16), True),
        (torch.ones(MAX_MESSAGE_BYTES // 2 + 1, dtype=torch.bfloat16), False),  # prefill: NCCL
        (torch.ones(8, dtype=torch.float16), True),
        (torch.ones(8, dtype=torch.float32), True),
        (torch.ones(8, dtype=torch.float64), False),
        (torch.ones(8, dtype=torch.int64), False),
        (torch.ones(8, 4, dtype=torch.float32).t(), False),  # not contiguous
        (torch.ones(0, dtype=torch.float32), False),
        (torch.ones(8, dtype=torch.float32, device="meta"), False),  # another device
    ],
)
def test_the_peer_path_takes_small_contiguous_float_messages_on_its_device(x, taken):
    assert cpu_reducer().takes(x) is taken


def test_closing_the_group_frees_the_blocks_and_the_path_takes_nothing_after():
    reducer = cpu_reducer()
    control = TPControl(0, 1)
    control.on_close(reducer.close)
    x = torch.ones(8)
    assert reducer.takes(x)
    control.close()
    assert reducer.blocks.closed and reducer.blocks.blocks == [] and not reducer.takes(x)


def test_a_device_side_stall_fails_the_group_at_its_next_collective_naming_the_late_rank():
    reducer = cpu_reducer(rank=0)
    cfg = TPConfig(failure_exit_s=1.0, peer_timeout_s=0.2, peer_watch_interval_s=0.05)
    control = TPControl(0, 2, cfg)  # no store: the failure is this rank's report
    control.add_check(reducer.check)
    ran: list[str] = []
    assert control.guard("step plan 3 broadcast", lambda: ran.append("plan")) is None
    reducer.host_error[0] = (17 << 8) | (1 + 1)  # what the kernel writes: call 17 waited for rank 1
    with pytest.raises(TPError) as failed:
        control.guard("step plan 4 broadcast", lambda: ran.append("plan"))
    assert ran == ["plan"]  # the collective is not entered once the group is known broken
    assert failed.value.culprit_rank == 1
    assert failed.value.failure.message == (
        "rank 1 failed in step plan 4 broadcast: PeerAllReduceStalled: rank 0: peer all-reduce call 17 "
        "waited 120s for rank 1, which never reached it"
    )


def test_the_deadline_moves_into_the_table_the_kernel_reads():
    reducer = cpu_reducer()
    reducer.set_timeout(2.5)
    world = reducer.launch.world
    assert int(reducer.table[world + 1]) == 2_500_000_000  # TIMEOUT_NS_SLOT, read at every launch
    with pytest.raises(PeerAllReduceStalled, match="waited 2.5s"):
        reducer.host_error[0] = (1 << 8) | 2
        reducer.check()


def test_gather_on_one_rank_is_its_own_value():
    assert TPControl(0, 1).gather({"a": 1}, "what") == [{"a": 1}]


def test_the_knob_takes_auto_or_nccl():
    # auto by default: on 2 x H200 the peer path is faster than NCCL up to MAX_MESSAGE_BYTES (and
    # NCCL takes the rest); where a rank cannot take it, torch.distributed serves (test_allreduce_choice)
    assert EngineConfig().tp_allreduce == "auto"
    EngineConfig().validate("services.thinker.engine")
    EngineConfig(tp_allreduce="nccl").validate("services.thinker.engine")
    with pytest.raises(
        ConfigError, match=r"services.thinker.engine.tp_allreduce: expected one of auto, nccl"
    ):
        EngineConfig(tp_allreduce="peer").validate("services.thinker.engine")  # type: ignore[arg-type]
