"""Checks of a public GenerateRequest, turned into what the pipeline runs.

Every refusal names the field and the rule (`messages[1].parts[0]: image input needs the 'encoder'
stage, which is not deployed`), so a client can fix its request without reading server logs. Counts
(messages, parts) are checked before any content is looked at, and the prompt's size (system prompt,
texts and chat markup) before it goes to the thinker, so a huge request costs the gateway little
and the thinker nothing. Sampling follows the shared rules of `common/sampling.py`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable
from omnistage.common.sampling import check_sampling
from omnistage.services.gateway.prompt import DEFAULT_SYSTEM_PROMPT, Turn, build_chat, prompt_chars
from omnistage.v1 import common_pb2, omni_pb2, thinker_pb2

MAX_REQUEST_ID_CHARS = 256
_MEDIA_STAGE = {"image": "encoder", "audio": "encoder", "video": "encoder"}
_OUTPUT_STAGE = {omni_pb2.MODALITY_AUDIO: "talker", omni_pb2.MODALITY_IMAGE: "imagegen"}


@dataclass(frozen=True)
class RequestLimits:
    """Bounds of one request: the gateway's deploy-file keys plus the thinker's max_model_len."""

    max_messages: int = 256
    max_parts_per_message: int = 64
    max_prompt_chars: int = 200_000
    # From the thinker's Describe Limits; None while unknown (then only the thinker checks it).
    max_model_len: int | None = None


@dataclass(frozen=True)
class PlannedRequest:
    """A validated request: the prompt for the thinker and what else the pipeline must do."""

    request_id: str
    prompt: thinker_pb2.ChatPrompt
    sampling: common_pb2.SamplingParams
    outputs: frozenset[int]


def _check_counts(req: omni_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Before anything else: how many messages and parts, and the system prompt's length."""
    if len(req.messages) > limits.max_messages:
        raise InvalidRequest(f"messages: {len(req.messages)} messages, at most {limits.max_messages} (max_messages)")
    for i, msg in enumerate(req.messages):
        if len(msg.parts) > limits.max_parts_per_message:
            raise InvalidRequest(
                f"messages[{i}].parts: {len(msg.parts)} parts, at most {limits.max_parts_per_message} "
                "(max_parts_per_message)"
            )
    if len(req.system_prompt) > limits.max_prompt_chars:
        raise InvalidRequest(
            f"system_prompt: {len(req.system_prompt)} characters, the prompt limit is {limits.max_prompt_chars}"
        )


def _check_outputs(req: omni_pb2.GenerateRequest, deployed: set[str]) -> set[int]:
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
    return outputs


def _message_text(where: str, msg: omni_pb2.ChatMessage, deployed: set[str]) -> str:
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
            raise StageUnavailable(f"{where}.parts[{j}]: {kind} input is not wired into the gateway yet", retryable=False)
        if not part.text:
            raise InvalidRequest(f"{where}.parts[{j}].text: empty text (give it text or leave the part out)")
        texts.append(part.text)
    return "".join(texts)


def plan_request(
    req: omni_pb2.GenerateRequest, deployed: set[str], default_system_prompt: str, limits: RequestLimits
) -> PlannedRequest:
    """Validate `req` against the deployed stages and limits; raise InvalidRequest / StageUnavailable."""
    _check_counts(req, limits)
    request_id = req.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequest(f"request_id: must be printable and at most {MAX_REQUEST_ID_CHARS} characters")
    if not req.messages:
        raise InvalidRequest("messages: at least one message is required")
    outputs = _check_outputs(req, deployed)
    system_prompt = req.system_prompt
    turns: list[Turn] = []
    text_chars = len(system_prompt)
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if msg.role == omni_pb2.ROLE_SYSTEM:
            if i != 0:
                raise InvalidRequest(f"{where}.role: a system message may only be the first message")
            if system_prompt:
                raise InvalidRequest(f"{where}.role: system_prompt and a system message are both set")
        elif msg.role not in (omni_pb2.ROLE_USER, omni_pb2.ROLE_ASSISTANT):
            raise InvalidRequest(f"{where}.role: must be ROLE_SYSTEM, ROLE_USER or ROLE_ASSISTANT")
        text = _message_text(where, msg, deployed)
        text_chars += len(text)
        if text_chars > limits.max_prompt_chars:
            raise InvalidRequest(
                f"messages: the prompt passes {limits.max_prompt_chars} characters at {where} (max_prompt_chars)"
            )
        if msg.role == omni_pb2.ROLE_SYSTEM:
            system_prompt = text
        else:
            turns.append(Turn("user" if msg.role == omni_pb2.ROLE_USER else "assistant", text))
    if not turns or turns[-1].role != "user":
        raise InvalidRequest("messages: the last message must be from ROLE_USER")
    check_sampling(req.sampling, max_model_len=limits.max_model_len)
    chat = build_chat(turns, system_prompt or default_system_prompt or DEFAULT_SYSTEM_PROMPT)
    chars = prompt_chars(chat)
    if chars > limits.max_prompt_chars:
        raise InvalidRequest(
            f"messages: the prompt has {chars} characters with its chat markup, the limit is "
            f"{limits.max_prompt_chars} (max_prompt_chars)"
        )
    return PlannedRequest(request_id, chat, req.sampling, frozenset(outputs))
