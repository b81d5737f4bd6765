"""parse_request: defaults from the config, a random seed when unset (reported back), edits switchable,
every bad field named; the e2e test covers the same over gRPC and shared memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omnistage.common.config import ImageGenConfig
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.transport import TransportContext, encode
from omnistage.services.imagegen.request import RequestLimits, parse_request
from omnistage.v1 import imagegen_pb2

LIMITS = RequestLimits(
    ImageGenConfig(highres=512, default_side_px=512), num_queries=256, thinker_hidden=64, size_multiple=16
)


def _request(**fields) -> imagegen_pb2.ImageGenRequest:
    cond = encode(torch.randn(256, 64).to(torch.bfloat16), force="inline")
    return imagegen_pb2.ImageGenRequest(condition=cond, **fields)


def test_defaults_and_a_random_seed():
    with TransportContext() as t:
        a = parse_request(_request(), LIMITS, t)
        b = parse_request(_request(), LIMITS, t)
    assert (a.width, a.height, a.spec.bucket, a.spec.steps, a.spec.guidance_scale) == (
        512,
        512,
        (512, 512),
        30,
        2.0,
    )
    assert a.spec.condition.shape == (256, 64) and a.spec.condition.dtype == torch.bfloat16
    assert a.spec.seed != b.spec.seed and a.spec.reference is None


def test_explicit_values_pass_through():
    with TransportContext() as t:
        p = parse_request(
            _request(width=640, height=384, steps=7, guidance_scale=0.0, seed=2**64 - 1), LIMITS, t
        )
    assert (p.width, p.height, p.spec.bucket, p.spec.steps, p.spec.guidance_scale, p.spec.seed) == (
        640,
        384,
        (384, 640),
        7,
        0.0,
        2**64 - 1,
    )


def test_edits_can_be_turned_off():
    limits = dataclasses.replace(LIMITS, cfg=ImageGenConfig(allow_edits=False))
    with (
        TransportContext() as t,
        pytest.raises(InvalidRequest, match="reference_image: edits are turned off"),
    ):
        parse_request(_request(reference_image=b"\x89PNG"), limits, t)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"width": 64, "height": 272}, "aspect ratio 272/64 = 4.25 is outside [0.25, 4.0]"),
        ({"width": 48}, "width: 48 is outside [64, 2048]"),
        ({"guidance_scale": float("inf")}, "guidance_scale: must be a finite number, got inf"),
    ],
)
def test_bad_fields(fields, needle):
    with TransportContext() as t, pytest.raises(InvalidRequest) as err:
        parse_request(_request(**fields), LIMITS, t)
    assert needle in str(err.value)
