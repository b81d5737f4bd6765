"""Leaving a TP group: what must go before the process groups (CUDA graphs that captured
collectives hold the communicator) goes first, and a teardown that cannot finish does not keep the
rank from leaving."""

from __future__ import annotations

import logging
import threading

import pytest
from omnistage.common.config import TPConfig
from omnistage.services.thinker.tp import distributed
from omnistage.services.thinker.tp.distributed import TPControl


def test_close_hooks_run_once_in_order_and_a_failing_one_does_not_stop_the_rest():
    control = TPControl(0, 1)
    seen: list[str] = []
    control.on_close(lambda: seen.append("graphs"))
    control.on_close(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    control.on_close(lambda: seen.append("after"))
    control.close()
    control.close()
    assert seen == ["graphs", "after"]


def test_hooks_run_before_the_groups_are_destroyed_and_a_stuck_destroy_is_left_behind(monkeypatch, caplog):
    events: list[str] = []
    release = threading.Event()

    def stuck_destroy() -> None:
        events.append("destroy started")
        release.wait(60)  # a communicator a captured graph still holds: never returns by itself

    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", stuck_destroy)
    cfg = TPConfig(failure_exit_s=0.2, peer_timeout_s=0.1, peer_watch_interval_s=0.05)
    control = TPControl(0, 2, cfg)  # no store: no peer watch
    control.on_close(lambda: events.append("graphs released"))
    with caplog.at_level(logging.WARNING):
        control.close()
    release.set()
    assert events == ["graphs released", "destroy started"]
    assert "process groups not destroyed within" in caplog.text


@pytest.mark.parametrize("failed", [False, True])
def test_a_failed_group_is_not_destroyed_but_its_hooks_still_run(monkeypatch, failed):
    destroyed: list[bool] = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: destroyed.append(True))
    control = TPControl(1, 2, TPConfig())
    hooks: list[bool] = []
    control.on_close(lambda: hooks.append(True))
    if failed:
        control.failure = distributed.GroupFailure(0, "rank 0 died")
    control.close()
    assert hooks == [True] and destroyed == ([] if failed else [True])
