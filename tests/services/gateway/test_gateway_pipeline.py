"""The request plan: which stages a Generate request passes, in order, and how many thinker calls read
its media (what admission judges and who ends the media's leases)."""

from __future__ import annotations

from omnistage.services.gateway.outputs.image_options import ImagePlan
from omnistage.services.gateway.outputs.talker import VoiceChoice
from omnistage.services.gateway.plan import PlannedOutput, RequestPlan
from omnistage.services.gateway.validation import RequestLimits, plan_request
from omnistage.v1 import omni_pb2

DEPLOYED = {"thinker", "encoder", "talker", "imagegen"}
IMAGE = ImagePlan(0, 0, None, None, None, None)


def _plan(*outputs: int, media: bool = False) -> RequestPlan:
    parts = [omni_pb2.ContentPart(text="Hi")]
    if media:
        parts.append(omni_pb2.ContentPart(image=omni_pb2.Media(data=b"png")))
    request = omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=parts)], output_modalities=list(outputs)
    )
    planned = plan_request(request, DEPLOYED, "", RequestLimits())
    outputs = []
    if omni_pb2.MODALITY_AUDIO in planned.outputs:
        outputs.append(PlannedOutput("talker", omni_pb2.MODALITY_AUDIO, VoiceChoice()))
    if omni_pb2.MODALITY_IMAGE in planned.outputs:
        outputs.append(
            PlannedOutput("imagegen", omni_pb2.MODALITY_IMAGE, IMAGE, after_answer=True, thinker_calls=1)
        )
    return RequestPlan(planned, {}, 0.0, tuple(outputs))


def test_a_text_request_passes_the_thinker_alone_in_one_call():
    plan = _plan()
    assert plan.stages == ["thinker"] and plan.answers and plan.thinker_calls == 1


def test_a_spoken_answer_of_media_passes_encoder_thinker_talker_in_that_order():
    plan = _plan(omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO, media=True)
    assert plan.stages == ["encoder", "thinker", "talker"] and plan.thinker_calls == 1


def test_text_and_image_read_the_media_in_two_thinker_calls_before_the_image_stage():
    plan = _plan(omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_IMAGE, media=True)
    assert plan.stages == ["encoder", "thinker", "imagegen"] and plan.answers and plan.thinker_calls == 2


def test_an_image_alone_has_no_answer_and_one_hidden_state_call():
    plan = _plan(omni_pb2.MODALITY_IMAGE)
    assert plan.stages == ["thinker", "imagegen"] and not plan.answers and plan.thinker_calls == 1
