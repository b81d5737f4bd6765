"""The peer all-reduce on GPUs (skipped without CUDA; the lead runs it on a lent machine): two rank
processes, on one GPU (CUDA IPC within a device) and on two GPUs (next to NCCL), through the
thinker's TP group. The start-up choice takes the peer path; every sum of bf16 and fp32 messages
from 4 KiB to 1 MiB, eager and replayed from a CUDA graph, equals the fp32 rank-order sum on every
rank bit for bit (and NCCL's within bf16 rounding); a rank calling alone stops at the deadline
naming the other, and its next call does not wait."""

from __future__ import annotations

import pytest
import torch

from tests.services.thinker.tp.peer_ranks import PeerCheck, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("same_gpu", [True, False], ids=["one-gpu", "two-gpus"])
def test_two_ranks_sum_right_everywhere_and_a_lone_rank_names_its_peer(tmp_path, same_gpu):
    if not same_gpu and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    check = PeerCheck(str(tmp_path), same_gpu=same_gpu, iters=5, graph_calls=2, replays=2, deadline_s=150)
    result = run_ranks(check)
    ranks = result["ranks"]
    assert result["exit_codes"] == [0, 0], ranks
    assert [r["choice"]["path"] for r in ranks] == ["peer", "peer"], ranks
    assert len(result["rows"]) == len(check.sizes) * len(check.dtypes)
    wrong = [(row["dtype"], row["bytes"]) for row in result["rows"] if not row["equal"]]
    assert wrong == []
    if not same_gpu:
        for row in result["rows"]:  # NCCL sums in another order: equal within one bf16 rounding step
            assert row["nccl_max_diff"] <= (0.0 if row["dtype"] == "float32" else 0.125), row
    stall = ranks[0]["stall"]
    assert stall["named_rank"] == 1, stall
    assert "waited 2s for rank 1" in stall["message"]
    assert "next_call_s" in stall  # the call after the failure returned (no second wait)
