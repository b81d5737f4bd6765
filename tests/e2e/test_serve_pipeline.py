"""The e2e tests' launch-and-wait (serve_pipeline.wait_started): a start that fails or runs out of time
fails the test naming each stage, rank and phase not serving, from the status files the processes wrote."""

from __future__ import annotations

import pytest
from omnistage.common.runtime.status_file import StatusRecord, status_path, write_status

from tests.e2e.serve_pipeline import stage_diagnosis, wait_started


def _status(run_dir, service: str, rank: int, phase: str, **fields) -> None:
    write_status(
        status_path(run_dir, service, rank),
        StatusRecord(service=service, rank=rank, pid=1, phase=phase, **fields),
    )


def test_a_process_that_exits_first_fails_the_wait_naming_the_stages_still_starting(tmp_path):
    _status(tmp_path, "gateway", 0, "serving")
    _status(tmp_path, "thinker", 0, "loading_weights", done=2, total=3, unit="shards")
    _status(tmp_path, "thinker", 1, "failed", failed_in="loading_weights", failure="exited with code 3")
    stopped = []
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_started(
            "the pipeline",
            lambda: False,
            lambda: "omnistage serve (exit 1)",
            60.0,
            tmp_path,
            lambda: "--- launcher output ---",
            on_failure=lambda: stopped.append(True),
        )
    message = str(failed.value)
    assert message.startswith("omnistage serve (exit 1) ended before the pipeline was ready")
    assert "thinker r0 in phase loading_weights: 2/3 shards" in message
    assert "thinker r1 in phase loading_weights: exited with code 3" in message
    assert "gateway" not in message.split("--- launcher output ---")[0]  # a serving stage is not blamed
    assert stopped == [True]  # what was started is stopped before the test fails


def test_the_deadline_fails_the_wait_naming_it_and_the_stage(tmp_path):
    _status(tmp_path, "talker", 0, "warming_up")
    polls = []
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_started("the talker", lambda: polls.append(1) and False, lambda: "", 0.0, tmp_path, lambda: "")
    assert "timed out after 0s waiting for the talker to be ready" in str(failed.value)
    assert "talker r0 in phase warming_up" in str(failed.value)
    assert polls == [1]  # polled once, then the (spent) deadline ended the wait


def test_ready_ends_the_wait_without_a_diagnosis(tmp_path):
    answers = iter([False, False, True])
    wait_started("the pipeline", lambda: next(answers), lambda: "", 60.0, tmp_path, lambda: "")
    assert next(answers, "done") == "done"
    assert stage_diagnosis(tmp_path).startswith("every stage that wrote a status")
