"""The gateway's client-side metrics: TTFT, E2E by outcome, goodput, tokens, refusals by reason."""

from __future__ import annotations

import asyncio

import pytest
from omnistage.common.runtime.errors import Overloaded
from omnistage.services.gateway.pipeline import Pipeline
from omnistage.services.gateway.request_metrics import modality_label
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import omni_pb2
from prometheus_client import REGISTRY

from tests.services.gateway.test_gateway_server import Context, FakeThinker


def _value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"service": "gw-metrics", **labels}) or 0.0


def _request() -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Hi")])]
    )


def _servicer(limit: int = 4) -> OmniServicer:
    return OmniServicer(
        Pipeline(
            FakeThinker(),
            {"thinker"},
            max_concurrent_requests=limit,
            limits=RequestLimits(),
            system_prompt="",
            service="gw-metrics",
        )
    )


async def _collect(servicer: OmniServicer) -> list[omni_pb2.GenerateEvent]:
    return [e async for e in servicer.Generate(_request(), Context())]


def test_a_finished_request_counts_ttft_e2e_goodput_and_tokens():
    before = {
        n: _value(n, **lab)
        for n, lab in [
            ("omnistage_gateway_ttft_seconds_count", {"modality": "text"}),
            ("omnistage_gateway_e2e_seconds_count", {"modality": "text", "outcome": "OK"}),
            ("omnistage_gateway_goodput_requests_total", {"modality": "text"}),
            ("omnistage_gateway_streamed_tokens_total", {"method": "Generate"}),
        ]
    }
    asyncio.run(_collect(_servicer()))
    assert (
        _value("omnistage_gateway_ttft_seconds_count", modality="text")
        == before["omnistage_gateway_ttft_seconds_count"] + 1
    )
    assert (
        _value("omnistage_gateway_e2e_seconds_count", modality="text", outcome="OK")
        == before["omnistage_gateway_e2e_seconds_count"] + 1
    )
    assert (
        _value("omnistage_gateway_goodput_requests_total", modality="text")
        == before["omnistage_gateway_goodput_requests_total"] + 1
    )
    assert (
        _value("omnistage_gateway_streamed_tokens_total", method="Generate")
        == before["omnistage_gateway_streamed_tokens_total"] + 2
    )  # two deltas of one token


def test_a_refusal_counts_its_reason_and_an_e2e_with_its_status_and_no_goodput():
    servicer = _servicer(limit=1)
    servicer.pipeline.admission.in_flight = 1  # the gateway is full
    refused = _value("omnistage_gateway_refusals_total", reason="gateway_full")
    goodput = _value("omnistage_gateway_goodput_requests_total", modality="text")
    with pytest.raises(Overloaded):
        asyncio.run(_collect(servicer))
    assert _value("omnistage_gateway_refusals_total", reason="gateway_full") == refused + 1
    assert _value("omnistage_gateway_e2e_seconds_count", modality="text", outcome="RESOURCE_EXHAUSTED") >= 1
    assert _value("omnistage_gateway_goodput_requests_total", modality="text") == goodput
    assert _value("omnistage_gateway_refusals_total", reason="thinker_deadline") == 0  # exported at 0


def test_a_client_that_leaves_is_counted_cancelled_and_the_stream_closed():
    servicer = _servicer()

    async def leave_after_one() -> None:
        stream = servicer.Generate(_request(), Context())
        await anext(stream)
        await stream.aclose()

    before = _value("omnistage_gateway_e2e_seconds_count", modality="text", outcome="CANCELLED")
    asyncio.run(leave_after_one())
    assert _value("omnistage_gateway_e2e_seconds_count", modality="text", outcome="CANCELLED") == before + 1
    assert servicer.pipeline.in_flight == 0


@pytest.mark.parametrize(
    ("modalities", "label"),
    [
        ([], "text"),
        ([omni_pb2.MODALITY_AUDIO, omni_pb2.MODALITY_TEXT], "audio+text"),
        ([omni_pb2.MODALITY_IMAGE], "image"),
        ([99], "invalid"),
    ],
)
def test_modality_label(modalities, label):
    assert modality_label(omni_pb2.GenerateRequest(output_modalities=modalities)) == label
