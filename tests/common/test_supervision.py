"""The launcher's supervision rules without processes: restart budget, backoff, the hung test."""

from __future__ import annotations

import pytest
from omnistage.common.config import ConfigError, SupervisionConfig, load_config
from omnistage.common.supervision import HealthProbe, RestartBudget, hung_cause


def test_restart_budget_counts_within_the_window_and_backs_off_exponentially_capped():
    cfg = SupervisionConfig(max_restarts=3, restart_window_s=100.0, backoff_initial_s=1.0, backoff_max_s=3.0)
    budget = RestartBudget(cfg)
    assert [budget.attempt(t) for t in (0.0, 10.0, 20.0)] == [1, 2, 3]
    assert budget.attempt(30.0) is None  # a fourth failure inside the window: exhausted
    assert [budget.delay_s(k) for k in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 3.0]
    assert budget.attempt(105.0) == 3  # the failure at 0 s left the window


def test_no_restarts_when_max_restarts_is_0():
    assert RestartBudget(SupervisionConfig(max_restarts=0)).attempt(0.0) is None


def test_hung_cause_names_the_silence_and_the_timeout():
    cfg = SupervisionConfig(heartbeat_timeout_s=10.0)
    assert hung_cause(cfg, "serving", 1.0, 1.0) == ""
    assert hung_cause(cfg, "serving", 10.2, None) == (
        "stopped answering for 10.2s (heartbeat timeout 10s) while serving"
    )
    assert "has not answered health for 12.0s" in hung_cause(cfg, "draining", 0.5, 12.0)


def test_supervision_keys_are_typed_and_checked(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("version: 1\nservices: {a: {port: 7000}}\n")
    assert load_config(path, ["supervision.max_restarts=2"]).supervision.max_restarts == 2
    with pytest.raises(
        ConfigError, match="supervision.heartbeat_interval_s: must be below heartbeat_timeout_s"
    ):
        load_config(path, ["supervision.heartbeat_interval_s=20"])
    with pytest.raises(ConfigError, match="supervision.max_restarts"):
        load_config(path, ["supervision.max_restarts=-1"])


class _Future:
    def __init__(self) -> None:
        self.answer: object = None  # None: still in flight; an exception: no answer

    def done(self) -> bool:
        return self.answer is not None

    def result(self) -> object:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def cancel(self) -> None:
        pass


class _Channel:
    """What HealthStub asks of a channel: Check.future returns the test's futures in order."""

    def __init__(self) -> None:
        self.sent: list[_Future] = []

    def unary_unary(self, *args, **kwargs):
        channel = self

        class _Method:
            def future(self, request, timeout):
                channel.sent.append(_Future())
                return channel.sent[-1]

        return _Method()

    unary_stream = unary_unary  # Watch: never called


def test_health_probe_times_silence_from_the_first_unanswered_probe():
    import grpc

    channel = _Channel()
    probe = HealthProbe(channel)  # type: ignore[arg-type]
    probe.poll(100.0, interval_s=2.0, timeout_s=1.0)
    channel.sent[-1].answer = "SERVING"
    probe.poll(100.2, 2.0, 1.0)
    assert probe.silent_s(100.2) == 0.0
    probe.poll(102.2, 2.0, 1.0)  # sent at 102.2; the process stops answering
    assert probe.silent_s(103.0) == pytest.approx(0.8)
    channel.sent[-1].answer = grpc.RpcError()  # deadline exceeded
    probe.poll(104.2, 2.0, 1.0)  # collected, and the next one sent: silence still counts from 102.2
    assert probe.silent_s(110.0) == pytest.approx(7.8)
