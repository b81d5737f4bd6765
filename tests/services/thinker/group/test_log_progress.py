"""LogProgress: the log line of a group failure names the rank at fault whenever it comes."""

from __future__ import annotations

import logging

from omnistage.services.thinker.group.startup import LogProgress
from omnistage.services.thinker.tp.tp_store import GroupFailure


def test_a_failure_while_serving_is_not_called_a_start_up_failure(caplog):
    """The listener stays on the group after start-up, so its line must not claim start-up failed."""
    with caplog.at_level(logging.ERROR):
        LogProgress(rank=0).failed(GroupFailure(1, "thinker r1 died while serving", "died"))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "start-up" not in line
    assert "rank 1 at fault" in line and "thinker r1 died while serving" in line
