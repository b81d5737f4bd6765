"""What can never be served is INVALID_ARGUMENT whatever the load and the deadline: the gateway learns
the thinker's max_model_len from its Describe and checks max_tokens against it before admission prices
the request (issue 30, point 1). The gate is loaded and the pace measured as if by a busy thinker;
nothing here depends on how fast the machine is."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from omnistage.common.runtime.errors import InvalidRequest, Overloaded
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import common_pb2, control_pb2, omni_pb2

from tests.services.gateway.gateway_speech_fakes import Context, FakeThinker

MAX_MODEL_LEN = 1024


def _busy_servicer(thinker: FakeThinker | None = None) -> OmniServicer:
    """A gateway whose thinker said max_model_len 1024, every slot taken and a slow measured pace: any
    request with a deadline of a few seconds is refused for load when it is possible at all."""
    pipeline = Pipeline(
        thinker or FakeThinker(),
        {"thinker"},
        max_concurrent_requests=100,
        limits=RequestLimits(),
        system_prompt="",
    )
    pipeline.thinker_described(
        control_pb2.Limits(max_running_requests=2, max_model_len=MAX_MODEL_LEN, default_max_tokens=64)
    )
    pipeline.thinker_gate.running = 2
    pipeline.thinker_gate.service_s = 30.0
    pipeline.admission.pace.observe(1, 0.05)
    pipeline.admission.pace.observe(2, 0.1)
    return OmniServicer(pipeline)


def _request(max_tokens: int) -> omni_pb2.GenerateRequest:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Hello")])
    return omni_pb2.GenerateRequest(messages=[msg], sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


async def _outcome(servicer: OmniServicer, max_tokens: int, deadline_s: float) -> tuple[str, str]:
    try:
        async for _ in servicer.Generate(_request(max_tokens), Context(deadline_s)):
            pass
    except (InvalidRequest, Overloaded) as exc:
        return exc.code.name, str(exc)
    return "OK", ""


@pytest.mark.parametrize("max_tokens", [MAX_MODEL_LEN + 1, 2000, 10**6, 4_000_000_000, 2**32 - 1])
@pytest.mark.parametrize("deadline_s", [5.0, 20.0, None])
def test_max_tokens_above_the_context_is_invalid_argument_on_a_loaded_gateway(max_tokens, deadline_s):
    code, message = asyncio.run(_outcome(_busy_servicer(), max_tokens, deadline_s))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.name
    assert message == f"sampling.max_tokens: {max_tokens} exceeds max_model_len {MAX_MODEL_LEN}"


def test_max_tokens_that_leaves_no_room_for_any_prompt_is_invalid_argument():
    code, message = asyncio.run(_outcome(_busy_servicer(), MAX_MODEL_LEN, 5.0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.name
    assert message == (
        f"sampling.max_tokens: {MAX_MODEL_LEN} + a prompt of at least 1 token(s) exceeds max_model_len "
        f"{MAX_MODEL_LEN}"
    )


def test_a_possible_request_on_the_same_loaded_gateway_is_still_refused_as_not_now():
    """The check refuses only the impossible: a request that fits the context is priced as before."""
    code, message = asyncio.run(_outcome(_busy_servicer(), MAX_MODEL_LEN - 1, 5.0))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.name and "deadline" in message


def test_the_idle_gateway_never_sends_an_impossible_request_to_the_thinker():
    thinker = FakeThinker("Hi. ")
    servicer = _busy_servicer(thinker)
    servicer.pipeline.thinker_gate.running = 0
    assert asyncio.run(_outcome(servicer, 5000, 5.0))[0] == grpc.StatusCode.INVALID_ARGUMENT.name
    assert thinker.calls == []
    assert asyncio.run(_outcome(servicer, 16, 5.0)) == ("OK", "")  # a possible one is served
    assert len(thinker.calls) == 1


def test_without_the_thinkers_limits_the_gateway_leaves_the_check_to_the_thinker():
    pipeline = Pipeline(
        FakeThinker("Hi. "), {"thinker"}, max_concurrent_requests=10, limits=RequestLimits(), system_prompt=""
    )
    assert asyncio.run(_outcome(OmniServicer(pipeline), 5000, 5.0)) == ("OK", "")  # the fake thinker takes it


def test_a_conversation_asking_for_max_tokens_above_the_context_is_refused_at_its_config():
    async def scenario():
        servicer = _busy_servicer(FakeThinker())

        async def requests():
            yield omni_pb2.ConverseRequest(
                config=omni_pb2.GenerateRequest(
                    output_modalities=[omni_pb2.MODALITY_TEXT],
                    sampling=common_pb2.SamplingParams(max_tokens=4_000_000_000),
                )
            )
            yield omni_pb2.ConverseRequest(text="Hi")

        with pytest.raises(InvalidRequest) as err:
            async for _ in servicer.Converse(requests(), Context(5.0)):
                pass
        return err.value, servicer.pipeline.in_flight

    err, in_flight = asyncio.run(scenario())
    assert str(err) == f"config.sampling.max_tokens: 4000000000 exceeds max_model_len {MAX_MODEL_LEN}"
    assert in_flight == 0
