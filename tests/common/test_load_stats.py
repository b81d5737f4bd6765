"""The load harness's arithmetic (common/load_stats.py) on synthetic records: percentiles,
rates over the wall time, goodput against each request's deadline, errors by status."""

from __future__ import annotations

import pytest
from omnistage.common.load_stats import Record, failures, markdown_table, percentile, summarize


def test_percentile_interpolates_between_ranks_like_numpy():
    xs = [float(x) for x in range(1, 101)]  # 1..100
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 95) == pytest.approx(95.05)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0 and percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


def test_summary_rates_goodput_latencies_and_errors():
    records = [
        # OK within the 2 s deadline: 10 tokens, first text at 0.1 s.
        Record("text", 0.0, 1.0, 2.0, completion_tokens=10, first_text_s=0.1),
        Record("text", 0.0, 1.5, 2.0, completion_tokens=10, first_text_s=0.3),
        # OK but late: counts for req/s and tok/s, not for goodput.
        Record("text", 0.0, 3.0, 2.0, completion_tokens=10, first_text_s=0.5),
        # Failed: counted by status, in no latency.
        Record("text", 0.0, 0.2, 2.0, code="RESOURCE_EXHAUSTED"),
        Record("text", 0.0, 0.2, 2.0, code="RESOURCE_EXHAUSTED"),
        Record("text", 0.0, 5.0, 2.0, code="DEADLINE_EXCEEDED"),
    ]
    s = summarize("closed", "text", "4", records, wall_s=2.0)
    assert (s.requests, s.ok, s.good) == (6, 3, 2)
    assert s.req_per_s == 1.5 and s.tok_per_s == 15.0 and s.goodput_per_s == 1.0
    assert s.e2e_ms["p50"] == 1500.0 and s.e2e_ms["p95"] == pytest.approx(2850.0)
    assert s.ttft_ms["p50"] == 300.0
    assert s.tpot_ms["p50"] == pytest.approx(1200.0 / 9, rel=1e-3)  # (1.5 - 0.3) / 9 tokens
    assert s.errors == {"RESOURCE_EXHAUSTED": 2, "DEADLINE_EXCEEDED": 1}
    assert s.ttfa_ms["p50"] is None and s.rtf["p50"] is None
    row = markdown_table([s]).splitlines()[-1]
    assert row == "| closed text | 4 | 6 (3 errors) | 2.0 s | 1500 ms | 2850 ms | 1.50 | 15.0 | 1.00/s |"


def test_speech_time_to_first_audio_and_real_time_factor():
    rec = Record(
        "speech",
        10.0,
        12.0,
        30.0,
        completion_tokens=5,
        first_text_s=0.2,
        first_audio_s=0.8,
        audio_seconds=4.0,
    )
    s = summarize("poisson", "speech", "1/s", [rec], wall_s=2.0)
    assert s.ttfa_ms["p50"] == 800.0 and s.rtf["p50"] == 0.5 and s.goodput_per_s == 0.5
    assert s.tpot_ms["p50"] == pytest.approx(1800.0 / 4)  # no last-delta time: (E2E - TTFT) / 4
    rec.last_text_s = 0.6
    assert rec.tpot_s == pytest.approx(0.1)  # the text alone: (0.6 - 0.2) / 4


def test_failures_name_each_run_with_requests_not_done_most_frequent_first():
    def rec(code: str) -> Record:
        return Record("speech", 0.0, 1.0, 30.0, code=code)

    runs = [
        summarize(
            "closed",
            "speech",
            "4",
            [
                rec("OK"),
                rec("AUDIO_RESOURCE_EXHAUSTED"),
                rec("AUDIO_RESOURCE_EXHAUSTED"),
                rec("DEADLINE_EXCEEDED"),
            ],
            1.0,
        ),
        summarize("closed", "text", "4", [rec("OK")], 1.0),
    ]
    assert failures(runs) == [
        "speech closed c=4: 3 of 4 not done: AUDIO_RESOURCE_EXHAUSTED 2, DEADLINE_EXCEEDED 1"
    ]
