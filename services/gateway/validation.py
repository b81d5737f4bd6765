"""Checks of a public GenerateRequest, turned into what the pipeline runs.

Every refusal names the field and the rule (`messages[1].parts[0]: image input needs the 'encoder'
stage, which is not deployed`), so a client can fix its request without reading server logs.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable
from omnistage.services.gateway.prompt import Turn, build_prompt
from omnistage.v1 import common_pb2, omni_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20
MAX_REQUEST_ID_CHARS = 256
_MEDIA_STAGE = {"image": "encoder", "audio": "encoder", "video": "encoder"}
_OUTPUT_STAGE = {omni_pb2.MODALITY_AUDIO: "talker", omni_pb2.MODALITY_IMAGE: "imagegen"}


@dataclass(frozen=True)
class PlannedRequest:
    """A validated request: the prompt for the thinker and what else the pipeline must do."""

    request_id: str
    prompt: str
    sampling: common_pb2.SamplingParams
    outputs: frozenset[int]


def _check_sampling(s: common_pb2.SamplingParams) -> None:
    def bad(field: str, rule: str, value: object) -> InvalidRequest:
        return InvalidRequest(f"sampling.{field}: {rule}, got {value!r}")

    for field in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
        value = getattr(s, field)
        if not math.isfinite(value):
            raise bad(field, "must be a finite number", value)
    if s.temperature < 0:
        raise bad("temperature", "must be >= 0 (0 means greedy)", s.temperature)
    if not 0 <= s.top_p <= 1:
        raise bad("top_p", "must be in [0, 1] (0 means off)", s.top_p)
    if s.top_k < 0:
        raise bad("top_k", "must be >= 0 (0 means off)", s.top_k)
    if not 0 <= s.min_p <= 1:
        raise bad("min_p", "must be in [0, 1] (0 means off)", s.min_p)
    if s.repetition_penalty < 0:
        raise bad("repetition_penalty", "must be > 0 (0 means off)", s.repetition_penalty)
    if not -2 <= s.presence_penalty <= 2:
        raise bad("presence_penalty", "must be in [-2, 2]", s.presence_penalty)
    if s.logprobs > MAX_LOGPROBS:
        raise bad("logprobs", f"must be <= {MAX_LOGPROBS}", s.logprobs)
    if len(s.stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings", len(s.stop))
    for i, stop in enumerate(s.stop):
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest(f"sampling.stop[{i}]: must be 1..{MAX_STOP_CHARS} characters, got {len(stop)}")
    for i, tid in enumerate(s.stop_token_ids):
        if tid < 0:
            raise InvalidRequest(f"sampling.stop_token_ids[{i}]: must be >= 0, got {tid}")


def plan_request(
    req: omni_pb2.GenerateRequest, deployed: set[str], default_system_prompt: str, max_prompt_chars: int
) -> PlannedRequest:
    """Validate `req` against the deployed stages; raise InvalidRequest / StageUnavailable."""
    request_id = req.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequest(f"request_id: must be printable and at most {MAX_REQUEST_ID_CHARS} characters")
    if not req.messages:
        raise InvalidRequest("messages: at least one message is required")
    outputs = set(req.output_modalities) or {omni_pb2.MODALITY_TEXT}
    for i, modality in enumerate(req.output_modalities):
        if modality not in (omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO, omni_pb2.MODALITY_IMAGE):
            raise InvalidRequest(f"output_modalities[{i}]: unknown modality {modality}")
    for modality in sorted(outputs):
        stage = _OUTPUT_STAGE.get(modality)
        if stage and stage not in deployed:
            name = omni_pb2.Modality.Name(modality)
            raise StageUnavailable(
                f"output_modalities: {name} needs the '{stage}' stage, which is not deployed", retryable=False
            )
    system_prompt = req.system_prompt
    turns: list[Turn] = []
    total_chars = 0
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if msg.role == omni_pb2.ROLE_SYSTEM:
            if i != 0:
                raise InvalidRequest(f"{where}.role: a system message may only be the first message")
            if system_prompt:
                raise InvalidRequest(f"{where}.role: system_prompt and a system message are both set")
        elif msg.role not in (omni_pb2.ROLE_USER, omni_pb2.ROLE_ASSISTANT):
            raise InvalidRequest(f"{where}.role: must be ROLE_SYSTEM, ROLE_USER or ROLE_ASSISTANT")
        if not msg.parts:
            raise InvalidRequest(f"{where}.parts: a message needs at least one part")
        texts = []
        for j, part in enumerate(msg.parts):
            kind = part.WhichOneof("content")
            if kind is None:
                raise InvalidRequest(f"{where}.parts[{j}]: empty part (set text, image, audio or video)")
            if kind != "text":
                stage = _MEDIA_STAGE[kind]
                if stage not in deployed:
                    raise StageUnavailable(
                        f"{where}.parts[{j}]: {kind} input needs the '{stage}' stage, which is not deployed",
                        retryable=False,
                    )
                raise StageUnavailable(
                    f"{where}.parts[{j}]: {kind} input is not wired into the gateway yet", retryable=False
                )
            texts.append(part.text)
        text = "".join(texts)
        total_chars += len(text)
        if msg.role == omni_pb2.ROLE_SYSTEM:
            system_prompt = text
        else:
            turns.append(Turn("user" if msg.role == omni_pb2.ROLE_USER else "assistant", text))
    if not turns or turns[-1].role != "user":
        raise InvalidRequest("messages: the last message must be from ROLE_USER")
    if total_chars > max_prompt_chars:
        raise InvalidRequest(f"messages: prompt has {total_chars} characters, the limit is {max_prompt_chars}")
    _check_sampling(req.sampling)
    prompt = build_prompt(turns, system_prompt or default_system_prompt)
    return PlannedRequest(request_id, prompt, req.sampling, frozenset(outputs))
