"""The table of stage kinds is what the deploy file, the launcher, preflight and the gateway read."""

from __future__ import annotations

import importlib.util

import pytest
from omnistage.common import launcher, preflight, stages
from omnistage.common.config import ConfigError, config_from_dict
from omnistage.common.runtime.errors import StageUnavailable
from omnistage.services.gateway import request_metrics
from omnistage.services.gateway.validation import RequestLimits, plan_request
from omnistage.v1 import control_pb2, omni_pb2


def test_every_kind_has_a_module_that_runs_it_and_a_describe_value():
    for stage in stages.STAGES:
        assert importlib.util.find_spec(f"{stage.module}.__main__") is not None, stage.kind
        assert control_pb2.StageKind.Value(f"STAGE_KIND_{stage.kind.upper()}") > 0


def test_the_deploy_file_accepts_exactly_the_kinds_of_the_table():
    for kind in stages.SERVICE_KINDS:
        cfg = config_from_dict({"services": {"s": {"kind": kind, "port": 1}}})
        assert cfg.services["s"].kind == kind
    with pytest.raises(ConfigError, match="services.s.kind: expected one of 'gateway', 'thinker'"):
        config_from_dict({"services": {"s": {"kind": "video", "port": 1}}})


def test_capabilities_follow_the_deployed_kinds():
    cfg = config_from_dict(
        {"services": {"t": {"kind": "thinker", "port": 1}, "v": {"kind": "talker", "port": 2}}}
    )
    assert cfg.capabilities() == ["text", "speech"]
    assert stages.CAPABILITIES["image_output"] == ("thinker", "imagegen")


def test_the_launcher_starts_the_tables_modules():
    assert launcher.MODULES is stages.MODULES
    assert stages.MODULES["encoder"] == "omnistage.services.encoder"


def test_preflight_checks_the_checkpoint_only_for_kinds_that_load_it(tmp_path):
    gateway_only = {"services": {"g": {"kind": "gateway", "port": 1}}}
    absent = str(tmp_path / "absent")
    assert (
        preflight.checkpoint_problems(config_from_dict({**gateway_only, "model": {"checkpoint": absent}}))
        == []
    )
    with_talker = {"services": {"v": {"kind": "talker", "port": 1}}, "model": {"checkpoint": absent}}
    (problem,) = preflight.checkpoint_problems(config_from_dict(with_talker))
    assert "needed by v" in problem


def _refusal(deployed: set[str], part: omni_pb2.ContentPart, *outputs: int) -> str:
    req = omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[part])], output_modalities=outputs
    )
    with pytest.raises(StageUnavailable) as err:
        plan_request(req, deployed, "", RequestLimits())
    return str(err.value)


def test_the_gateway_routes_media_and_outputs_by_the_table():
    text = omni_pb2.ContentPart(text="hi")
    video = omni_pb2.ContentPart(video=omni_pb2.Media(data=b"x", mime_type="video/mp4"))
    assert "video input needs the 'encoder' stage" in _refusal({"thinker"}, video)
    assert "MODALITY_AUDIO needs the 'talker' stage" in _refusal({"thinker"}, text, omni_pb2.MODALITY_AUDIO)
    assert "MODALITY_IMAGE needs the 'imagegen' stage" in _refusal(
        {"thinker", "talker"}, text, omni_pb2.MODALITY_IMAGE
    )
    assert "imagegen_queue_full" in request_metrics.REFUSAL_REASONS
    assert not any(r.startswith("gateway_") and r != "gateway_full" for r in request_metrics.REFUSAL_REASONS)
