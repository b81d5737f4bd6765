"""Admission by what a request costs: its tokens at the thinker's measured step time for the batch it
joins (pace.py), judged even when a slot is free. Step times are set as if measured: nothing here
depends on how fast the machine is."""

from __future__ import annotations

import grpc
import pytest
from omnistage.common.runtime.errors import Overloaded
from omnistage.services.gateway.admission import GateConfig, StageGate, check_path
from omnistage.services.gateway.pace import PaceMeter, StepPace
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.plan import RequestPlan
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.validation import RequestLimits, plan_request
from omnistage.v1 import common_pb2, omni_pb2


def test_step_time_is_interpolated_between_measured_batches_and_grows_beyond():
    pace = StepPace()
    assert pace.step_s(4) is None and pace.work_s(10, 0, 1) is None
    pace.observe(1, 0.01)
    pace.observe(9, 0.05)
    assert pace.step_s(1) == 0.01 and pace.step_s(9) == 0.05
    assert pace.step_s(5) == pytest.approx(0.03)  # halfway
    assert pace.step_s(18) == pytest.approx(0.10)  # beyond the largest: in proportion
    pace.observe(9, 0.10)  # a running mean: the newest counts a fifth
    assert pace.step_s(9) == pytest.approx(0.06)
    assert pace.work_s(100, 3 * 256 * 2, 1) == pytest.approx((100 + 2) * 0.01)  # 2 prefill steps


def test_a_meter_gives_the_step_time_between_the_first_and_last_token():
    meter = PaceMeter()
    meter.tokens(10.0, 1, 3)  # the first token: after the prefill, not counted
    assert meter.measured() is None
    meter.tokens(10.5, 1, 3)
    meter.tokens(11.0, 2, 5)  # two tokens in one event: two steps
    assert meter.measured() == (4, pytest.approx(1.0 / 3), pytest.approx(7 / 3))  # context: 1, 2, 4 tokens


def test_a_step_grows_with_the_context_beyond_the_one_it_was_measured_at():
    """Measured at 8 tokens of context per sequence; the thinker's decode step of 4 sequences took 15 ms
    at 16 tokens and 55 ms at 1016: each token of context of each sequence adds 1/4 of 0.27 % of the
    step, 13.3 us of the gateway's 20 ms. A request of 200 tokens runs its steps at its mean context."""
    pace = StepPace()
    pace.observe(4, 0.02, context=8)
    assert pace.per_context_token_s == 0.0  # not told: flat
    pace.observe_growth(4, (16, 0.015), (1016, 0.055))
    slope = 0.02 * (0.055 / 0.015 - 1) / 1000 / 4
    assert pace.per_context_token_s == pytest.approx(slope)
    assert pace.step_s(4, 8) == 0.02 and pace.step_s(4, 3) == 0.02  # never below what was measured
    assert pace.step_s(4, 108) == pytest.approx(0.02 + 4 * 100 * slope)
    assert pace.step_s(2, 108) == pytest.approx(0.02 + 2 * 100 * slope)  # fewer sequences grow it less
    assert pace.work_s(200, 3 * 8, 4) == pytest.approx((200 + 1) * (0.02 + 4 * 100 * slope))
    pace.observe_growth(4, (16, 0.045), (1016, 0.165))  # timed on a host 3 times slower: the same growth
    assert pace.per_context_token_s == pytest.approx(slope)
    pace.observe_growth(4, (16, 0.05), (1016, 0.04))  # noise that says it shrinks: flat
    assert pace.per_context_token_s == 0.0


def test_live_steps_at_a_longer_context_do_not_steepen_the_growth():
    """The gateway's step at the full batch is the growth's measure; live answers update it at the
    context they ran at, which the growth itself explains: it is taken back to the short context."""
    pace = StepPace()
    pace.observe(4, 0.02, context=16)
    pace.observe_growth(4, (16, 0.015), (1016, 0.055))
    slope = pace.per_context_token_s
    for _ in range(40):  # live steps at 516 tokens a sequence, as long as the growth says
        pace.observe(4, 0.02 + slope * 4 * 500, context=516)
    assert pace.per_context_token_s == pytest.approx(slope)
    assert pace.step_s(4, 1016) == pytest.approx(0.02 + slope * 4 * 1000)


def test_a_request_that_cannot_finish_at_the_batch_it_joins_is_refused_though_a_slot_is_free():
    gate = StageGate("thinker", GateConfig(max_running=8, max_waiting=64))
    gate.running = 2  # six slots free: slot counting alone would admit
    check_path([gate], 10.0, {"thinker": 9.0})  # fits
    with pytest.raises(Overloaded) as exc:
        check_path([gate], 10.0, {"thinker": 12.0})
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.value.retry_after_ms > 0
    assert "12.0s of service exceeds the 10.0s left to the deadline" in str(exc.value)


class _Context:
    def __init__(self, remaining_s: float) -> None:
        self.remaining_s = remaining_s

    def time_remaining(self) -> float:
        return self.remaining_s


def _plan(max_tokens: int):
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Hello")])
    req = omni_pb2.GenerateRequest(messages=[msg], sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    return plan_request(req, {"thinker"}, "", RequestLimits())


def test_the_gateway_admits_by_max_tokens_at_the_measured_pace_of_the_batch_it_joins():
    """A burst on a seeded pace: the first requests fit (batch 1 is quick), once the batch is large each
    request's 256 steps no longer fit 15 s and it is refused at arrival, not timed out later."""
    servicer = OmniServicer(
        Pipeline(None, {"thinker"}, max_concurrent_requests=1000, limits=RequestLimits(), system_prompt="")
    )
    gate = servicer.pipeline.thinker_gate
    gate.set_capacity(96)
    servicer.pipeline.admission.pace.observe(1, 0.005)  # the warm-up: alone ...
    servicer.pipeline.admission.pace.observe(96, 0.08)  # ... and at a full batch
    outcomes, on_their_way = [], []
    for _ in range(96):  # all judged before any of them reached the thinker's gate (a burst)
        try:
            servicer.pipeline.admission.check(
                ["thinker"], 15.0, servicer.pipeline.admission.thinker_work(RequestPlan(_plan(256), {}, 0.0))
            )
        except Overloaded as exc:
            outcomes.append("refused")
            assert exc.reason == "thinker_deadline"
            continue
        outcomes.append("admitted")
        on_their_way.append(gate.on_its_way())  # as Generate counts it until it takes its slot
        on_their_way[-1].__enter__()
    assert gate.coming == outcomes.count("admitted") and gate.running == 0
    admitted = outcomes.count("admitted")
    assert outcomes == ["admitted"] * admitted + ["refused"] * (
        96 - admitted
    )  # refused once the batch is too slow
    assert 0 < admitted < 96
    # every admitted request finishes within 15 s at the batch it ended up in
    assert servicer.pipeline.admission.pace.work_s(256, len("Hello"), admitted) <= 15.0
    unmeasured = OmniServicer(
        Pipeline(None, {"thinker"}, max_concurrent_requests=10, limits=RequestLimits(), system_prompt="")
    )
    assert (
        unmeasured.pipeline.admission.thinker_work(RequestPlan(_plan(256), {}, 0.0)) == {}
    )  # nothing measured yet: slots alone


def test_a_waiter_behind_requests_like_it_counts_their_cost_not_the_initial_guess():
    """The initial 2 s slot time would admit a waiter whose wait is really the running batch's 12 s."""
    gate = StageGate("thinker", GateConfig(max_running=2, max_waiting=64, initial_service_s=2.0))
    gate.running = 2
    check_path([gate], 15.0)  # slots alone: wait 2 s + 2 s fits
    with pytest.raises(Overloaded, match=r"at capacity .* wait 12\.0s plus 12\.0s of service"):
        check_path([gate], 15.0, {"thinker": 12.0})
