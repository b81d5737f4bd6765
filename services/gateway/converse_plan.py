"""The config of an Omni.Converse call (its first message), checked once: what every answer of the call
uses. Errors name `config.<field>`."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from omnistage.common.config import EncoderConfig, GatewayConfig
from omnistage.common.request_ids import MAX_REQUEST_ID_CHARS, valid_request_id
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.sampling import check_sampling
from omnistage.services.gateway.history import Entry
from omnistage.services.gateway.outputs.talker import VoiceChoice, voice_choice
from omnistage.services.gateway.prompt import DEFAULT_SYSTEM_PROMPT
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import common_pb2, omni_pb2

MIN_SAMPLE_RATE_HZ, MAX_SAMPLE_RATE_HZ = 8000, 48000  # a spoken turn's PCM


@dataclass(frozen=True)
class ConverseLimits:
    """The gateway's Converse keys (docs/config.md) and the encoder's limits on one request; the
    defaults are the deploy file's (the config classes own them)."""

    max_turns: int = GatewayConfig.converse_max_turns
    max_turn_chars: int = GatewayConfig.converse_max_turn_chars
    max_turn_audio_bytes: int = GatewayConfig.converse_max_turn_audio_bytes
    # From the encoder's deploy-file keys: the longest clip and the items of one Encode request.
    max_audio_seconds: float = EncoderConfig.max_audio_seconds
    max_audio_items: int = EncoderConfig.max_items_per_request


@dataclass(frozen=True)
class ConversePlan:
    """A checked config: what every answer of the call uses."""

    request_id: str
    system_prompt: str
    sampling: common_pb2.SamplingParams
    voice: VoiceChoice | None  # None: the answers are text only
    history: tuple[Entry, ...]

    @property
    def speaks(self) -> bool:
        return self.voice is not None

    @property
    def outputs(self) -> frozenset[int]:
        spoken = {omni_pb2.MODALITY_AUDIO} if self.speaks else set()
        return frozenset({omni_pb2.MODALITY_TEXT, *spoken})


def plan_converse(
    config: omni_pb2.GenerateRequest, limits: RequestLimits, default_system_prompt: str
) -> ConversePlan:
    """Check the call's config (the first message); errors name `config.<field>`."""
    request_id = config.request_id or uuid.uuid4().hex
    if not valid_request_id(request_id):
        raise InvalidRequest(
            f"config.request_id: must be printable and at most {MAX_REQUEST_ID_CHARS} characters"
        )
    for i, modality in enumerate(config.output_modalities):
        if modality not in (omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO):
            raise InvalidRequest(f"config.output_modalities[{i}]: Converse answers with text and speech only")
    # Empty: text and speech (a conversation speaks unless told otherwise); [MODALITY_TEXT]: text only.
    speaks = not config.output_modalities or omni_pb2.MODALITY_AUDIO in config.output_modalities
    if config.tools or config.tool_choice:
        raise InvalidRequest("config.tools: Converse takes no tools (use Generate)")
    if config.prompt or config.prompt_token_ids:
        raise InvalidRequest("config.prompt: Converse takes turns, not a raw prompt (use Generate)")
    system_prompt, seeded = _seeded_history(config, limits)
    try:
        check_sampling(config.sampling)
    except InvalidRequest as exc:
        raise InvalidRequest(f"config.{exc}") from None
    voice = voice_choice(config, "config.") if speaks else None
    system_prompt = system_prompt or default_system_prompt or DEFAULT_SYSTEM_PROMPT
    return ConversePlan(request_id, system_prompt, config.sampling, voice, tuple(seeded))


def _seeded_history(config: omni_pb2.GenerateRequest, limits: RequestLimits) -> tuple[str, list[Entry]]:
    """The config's system prompt and the history its messages seed (text only), within the limits."""
    if len(config.messages) > limits.max_messages:
        raise InvalidRequest(
            f"config.messages: {len(config.messages)} messages, at most {limits.max_messages} (max_messages)"
        )
    system_prompt = config.system_prompt
    seeded: list[Entry] = []
    for i, msg in enumerate(config.messages):
        where = f"config.messages[{i}]"
        text = _message_text(where, msg, limits)
        if msg.role == omni_pb2.ROLE_SYSTEM:
            if i != 0 or system_prompt:
                raise InvalidRequest(
                    f"{where}.role: a system message may only be the first message, without system_prompt"
                )
            system_prompt = text
        elif msg.role in (omni_pb2.ROLE_USER, omni_pb2.ROLE_ASSISTANT):
            seeded.append(Entry("user" if msg.role == omni_pb2.ROLE_USER else "assistant", text))
        else:
            raise InvalidRequest(f"{where}.role: must be ROLE_SYSTEM, ROLE_USER or ROLE_ASSISTANT")
    chars = len(system_prompt) + sum(len(e.text) for e in seeded)
    if chars > limits.max_prompt_chars:
        raise InvalidRequest(
            f"config.messages: {chars} characters, the prompt limit is {limits.max_prompt_chars} "
            "(max_prompt_chars)"
        )
    return system_prompt, seeded


def _message_text(where: str, msg: omni_pb2.ChatMessage, limits: RequestLimits) -> str:
    if not msg.parts:
        raise InvalidRequest(f"{where}.parts: a message needs at least one part")
    if len(msg.parts) > limits.max_parts_per_message:
        raise InvalidRequest(
            f"{where}.parts: {len(msg.parts)} parts, at most {limits.max_parts_per_message} "
            "(max_parts_per_message)"
        )
    for j, part in enumerate(msg.parts):
        if part.WhichOneof("content") != "text" or not part.text:
            raise InvalidRequest(
                f"{where}.parts[{j}]: the history of a Converse call takes non-empty text parts only"
            )
    return "".join(part.text for part in msg.parts)
