"""Start-up failures of one TP rank (gloo, simulated device): every rank ends because of the failure
(before run_ranks' deadline, while a collective would wait far longer: profile_helpers.TP_TEST), all
with the same diagnostic naming the rank, where and the cause.

The faults are the service's own hook (`fault.at`): a peer takes the device's memory just before the
KV rebuild or the validation stress (the allocation itself fails), or an out-of-memory error half-way
through the first warm-up forward. TP=4 with rank 0 (the store host) not the failing rank is the
measured outage: ranks 1 and 3 used to wait in a collective forever once rank 0 had left. That needs
a middle rank, so the warm-up fault runs at TP=4 on rank 2 (every bystander kind: the store host, a
rank before the culprit, one after); the other points (the KV rebuild, the validation, rank 0 as the
culprit) need two ranks only, so they run at TP=2. The warm-up fault needs no simulated device: its
ranks start on a plain CPU, without the KV auto-profile the other faults strike in (4 ranks' profiles
saved). The overshoot test's point is the profile's validation: its ranks skip the warm-up after it.
"""

from __future__ import annotations

import pytest

from tests.services.thinker.group.profile_helpers import MiB, run_ranks

CASES = {
    "rebuild": (
        "profiling_memory",
        "kv_rebuild",
        "failed in profiling_memory: KVProfileError: auto-profile failed",
    ),
    "validation": (
        "profiling_memory",
        "kv_validation",
        "failed in profiling memory (validation (attempt 1/4)",
    ),
    "warm-up": ("warming_up", "warmup_forward", "failed in warm-up shape 'prefill"),
}


def _check(results: dict, bad: int, expected: str, cause: str) -> None:
    messages = {r: res.get("message", "") for r, res in results.items()}
    for rank, res in results.items():
        assert res["status"] in ("failed", "error"), (rank, res)
        assert f"rank {bad} {expected}" in res["message"] and cause in res["message"], (rank, messages)
        assert res.get("culprit") == bad, (rank, res)
        assert res["exitcode"] != 0, (rank, res)
    assert len(set(messages.values())) == 1, f"ranks disagree on the diagnostic: {messages}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size, bad, case",
    [(2, 1, "rebuild"), (2, 0, "validation"), (4, 2, "warm-up")],
    ids=["tp2-rank1-rebuild", "tp2-rank0-validation", "tp4-rank2-warmup"],
)
def test_a_start_up_oom_on_one_rank_ends_every_rank_naming_it(tiny_ckpt, tmp_path, world_size, bad, case):
    phase, point, expected = CASES[case]
    fault = {"phase": phase, "action": "oom", "rank": bad, "at": point}
    plain_cpu = {"capacity": 0} if phase == "warming_up" else {}
    # run_ranks fails naming a rank still running
    results, _, _ = run_ranks(tiny_ckpt, tmp_path, world_size, fault=fault, **plain_cpu)
    _check(results, bad, expected, "OutOfMemoryError")


@pytest.mark.slow
def test_a_validation_step_a_little_over_the_probe_shrinks_on_every_rank_instead_of_failing(
    tiny_ckpt, tmp_path
):
    """Seen on 2 x H200 (fp32, ~121 GiB cache): a validation step needed 16 MiB more than the probe
    measured; with the canary held during the validation that was an OOM inside a TP forward, fatal to
    the group. The canary is proven, freed, and the validation's peak must leave it free: the overshoot
    is measured, agreed on, and both ranks shrink and serve."""
    results, _, _ = run_ranks(
        tiny_ckpt, tmp_path, 2, canary_bytes=32 * MiB, validation_extra_bytes=16 * MiB, warmup=False
    )
    for rank, res in results.items():
        assert res["status"] == "ok", (rank, res)
        assert res["attempts"] >= 2, (rank, res)  # the overshoot was measured and shrunk away
    assert results[0]["blocks"] == results[1]["blocks"]
