"""Checks of a public GenerateRequest, turned into what the pipeline runs."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from omnistage.common import context_rule as rule
from omnistage.common.request_ids import MAX_REQUEST_ID_CHARS, valid_request_id
from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable
from omnistage.common.runtime.wire_bounds import WireBounds
from omnistage.common.sampling import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, check_sampling
from omnistage.common.stages import MEDIA_INPUT_KIND, OUTPUT_KIND
from omnistage.services.gateway.prompt import (
    DEFAULT_SYSTEM_PROMPT,
    AnswerTokens,
    MediaSlot,
    ToolCallPart,
    Turn,
    build_chat,
    prompt_chars,
)
from omnistage.services.gateway.tools import MAX_TOOL_CALLS, ToolPlan, plan_tools
from omnistage.v1 import common_pb2, encoder_pb2, omni_pb2, thinker_pb2

# output_modalities holds each of the three modalities at most once in any sensible request; a few
# repeats are tolerated (a set is what counts), more are refused on the wire.
MAX_OUTPUT_MODALITIES = 8
# What a request carries besides its text and media: tags, lengths, roles, sampling, options, ids
# (a few bytes per part, a few KiB for the rest), generously.
_PART_OVERHEAD_BYTES = 64
_REQUEST_OVERHEAD_BYTES = 1 << 20

# Output modality → the stage kind that makes it (the stage table's output kinds).
OUTPUT_STAGE = {
    omni_pb2.Modality.Value(f"MODALITY_{name.upper()}"): kind for name, kind in OUTPUT_KIND.items()
}


_TURN_ROLE = {omni_pb2.ROLE_USER: "user", omni_pb2.ROLE_ASSISTANT: "assistant", omni_pb2.ROLE_TOOL: "tool"}


@dataclass(frozen=True)
class RequestLimits:
    """Bounds of one request's shape: the gateway's deploy-file keys. Tokens are the thinker's to count:
    its engine admits prompt + max_tokens against max_model_len with the precise error; the gateway
    refuses before admission only what no tokenization could fit (`check_context`)."""

    max_messages: int = 256
    max_parts_per_message: int = 64
    max_prompt_chars: int = 200_000


def wire_bounds(limits: RequestLimits) -> dict[str, WireBounds]:
    """The Omni methods' bounds on the raw request (checked before it is decoded): every repeated field
    of a GenerateRequest, so that 8 M empty messages or a packed field of 60 M modalities are refused
    before protobuf builds them and before any validation loops over them."""

    def bounds(descriptor, prefix: str) -> WireBounds:
        keyed = {
            f"{prefix}messages": (limits.max_messages, "gateway.max_messages"),
            f"{prefix}messages.parts": (limits.max_parts_per_message, "gateway.max_parts_per_message"),
            f"{prefix}output_modalities": (MAX_OUTPUT_MODALITIES, ""),
            f"{prefix}prompt_token_ids": (limits.max_prompt_chars, "gateway.max_prompt_chars"),
            f"{prefix}sampling.stop": (MAX_STOP_STRINGS, ""),
            f"{prefix}sampling.stop_token_ids": (MAX_STOP_TOKEN_IDS, ""),
        }
        return WireBounds(
            descriptor, {p: n for p, (n, _) in keyed.items()}, {p: k for p, (_, k) in keyed.items() if k}
        )

    return {
        "Generate": bounds(omni_pb2.GenerateRequest.DESCRIPTOR, ""),
        "Converse": bounds(omni_pb2.ConverseRequest.DESCRIPTOR, "config."),
        "Tokenize": bounds(omni_pb2.GenerateRequest.DESCRIPTOR, ""),
    }


def public_receive_bytes(limits: RequestLimits, media_bytes: int, voice_bytes: int) -> int:
    """The largest request message a legitimate client sends the public API (the gateway's gRPC
    receive limit, capped by its max_message_bytes): the media one encoder request takes
    (`media_bytes`, 0 without an encoder), a custom voice clip the talker takes (`voice_bytes`, 0
    without a talker), the prompt's characters as UTF-8 (4 bytes at most each), and the structure."""
    structure = limits.max_messages * limits.max_parts_per_message * _PART_OVERHEAD_BYTES
    return media_bytes + voice_bytes + 4 * limits.max_prompt_chars + structure + _REQUEST_OVERHEAD_BYTES


@dataclass(frozen=True)
class MediaPart:
    """One image, audio clip or video of the request, in prompt order (= the order it is encoded in)."""

    where: str  # the field path a client reads in errors: messages[0].parts[2].image
    kind: str  # "image" | "audio" | "video"
    media: omni_pb2.Media
    # A Converse turn's speech: `media.data` is mono PCM16 at this rate, sent to the encoder as samples
    # (no file to decode); 0 for a file.
    pcm_rate_hz: int = 0


@dataclass(frozen=True)
class PlannedRequest:
    """A validated request: the turns for the thinker's prompt and what else the pipeline must do."""

    request_id: str
    turns: tuple[Turn, ...]
    system_prompt: str
    sampling: common_pb2.SamplingParams
    outputs: frozenset[int]
    media: tuple[MediaPart, ...] = ()
    prompt_chars: int = 0  # with its chat markup (media placeholders not counted)
    tools: ToolPlan | None = None  # tools shown to the model (tools.py)
    raw: str | None = None  # GenerateRequest.prompt: continued as it is, no chat format
    raw_ids: tuple[int, ...] = ()  # GenerateRequest.prompt_token_ids: the same, as a client's token ids

    def chat(self, encoded: Sequence[encoder_pb2.EncodedItem] = ()) -> thinker_pb2.ChatPrompt:
        """The thinker's prompt; `encoded[i]` (the encoder's output for media[i]) sizes its placeholders."""
        if len(encoded) != len(self.media):
            raise ValueError(f"{len(self.media)} media parts, {len(encoded)} encoder outputs")
        if self.raw_ids:  # a client's ids: the thinker refuses special tokens among them
            piece = thinker_pb2.PromptPiece(client_tokens=thinker_pb2.TokenIds(ids=self.raw_ids))
            return thinker_pb2.ChatPrompt(pieces=[piece])
        if self.raw is not None:  # client text only: its special-token strings stay text
            return thinker_pb2.ChatPrompt(pieces=[thinker_pb2.PromptPiece(text=self.raw)])
        return _chat(self.turns, self.system_prompt, self.tools, encoded)

    @property
    def prompt(self) -> thinker_pb2.ChatPrompt:
        """The prompt of a text-only request."""
        return self.chat()

    @property
    def least_prompt_tokens(self) -> int:
        """Tokens its prompt has whatever the tokenizer: the ids it sends as they are (earlier answers),
        plus one (a prompt is never empty). Text and media rows only the thinker and encoder count."""
        if self.raw_ids:
            return len(self.raw_ids)
        return 1 + sum(
            len(part.ids) for turn in self.turns for part in turn.parts() if isinstance(part, AnswerTokens)
        )


def check_context(sampling: common_pb2.SamplingParams, least_prompt_tokens: int, max_model_len: int) -> None:
    """Refuse (INVALID_ARGUMENT) what can never be served, before admission prices it: max_tokens above
    the thinker's max_model_len (its Describe; 0: unknown, the thinker alone checks), or above what is
    left of it after the least the prompt can take. What only the prompt's tokenization makes too long
    is the thinker's to refuse, also INVALID_ARGUMENT."""
    if not max_model_len:
        return
    check_sampling(sampling, max_model_len=max_model_len)  # the shared rule: max_tokens > max_model_len
    rule.check_context(
        max_model_len, prompt_tokens=least_prompt_tokens, max_tokens=sampling.max_tokens, at_least=True
    )


def _chat(
    turns: Sequence[Turn],
    system_prompt: str,
    tools: ToolPlan | None,
    media: Sequence[encoder_pb2.EncodedItem] | None,
) -> thinker_pb2.ChatPrompt:
    if tools is None:
        return build_chat(turns, system_prompt, media=media)
    return build_chat(turns, system_prompt, media=media, tools=tools.shown, call_tool=tools.forced)


def check_counts(req: omni_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Before anything else: how many messages and parts, and the system prompt's length."""
    if len(req.messages) > limits.max_messages:
        raise InvalidRequest(
            f"messages: {len(req.messages)} messages, at most {limits.max_messages} (max_messages)"
        )
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


def _check_outputs(
    req: omni_pb2.GenerateRequest, deployed: set[str], output_kinds: dict[int, str]
) -> set[int]:
    if len(req.output_modalities) > MAX_OUTPUT_MODALITIES:  # the wire walk refuses these before decoding
        raise InvalidRequest(f"output_modalities: more than {MAX_OUTPUT_MODALITIES} elements")
    outputs = set(req.output_modalities) or {omni_pb2.MODALITY_TEXT}
    for i, modality in enumerate(req.output_modalities):
        if modality != omni_pb2.MODALITY_TEXT and modality not in output_kinds:
            raise InvalidRequest(f"output_modalities[{i}]: unknown modality {modality}")
    for modality in sorted(outputs):
        stage = output_kinds.get(modality)
        if stage and stage not in deployed:
            name = omni_pb2.Modality.Name(modality)
            raise StageUnavailable(
                f"output_modalities: {name} needs the '{stage}' stage, which is not deployed", retryable=False
            )
    return outputs


def _tool_calls(where: str, msg: omni_pb2.ChatMessage) -> list[ToolCallPart]:
    """An assistant message's earlier tool calls (other roles have none)."""
    if not msg.tool_calls:
        return []
    if msg.role != omni_pb2.ROLE_ASSISTANT:
        raise InvalidRequest(f"{where}.tool_calls: only an assistant message has tool calls")
    if len(msg.tool_calls) > MAX_TOOL_CALLS:
        raise InvalidRequest(f"{where}.tool_calls: {len(msg.tool_calls)} calls, at most {MAX_TOOL_CALLS}")
    for j, call in enumerate(msg.tool_calls):
        if not call.name:
            raise InvalidRequest(f"{where}.tool_calls[{j}].name: empty")
    return [ToolCallPart(c.name, c.arguments_json or "{}") for c in msg.tool_calls]


def _message_content(
    where: str, msg: omni_pb2.ChatMessage, deployed: set[str], media: list[MediaPart]
) -> tuple[str | MediaSlot | ToolCallPart, ...]:
    """Texts (adjacent ones joined), media slots and tool calls of one message, in order; media parts
    are appended to `media`."""
    calls = _tool_calls(where, msg)
    if not msg.parts and not calls:
        raise InvalidRequest(f"{where}.parts: a message needs at least one part")
    content: list[str | MediaSlot | ToolCallPart] = []
    for j, part in enumerate(msg.parts):
        kind = part.WhichOneof("content")
        if kind is None:
            raise InvalidRequest(f"{where}.parts[{j}]: empty part (set text, image, audio or video)")
        if kind != "text":
            stage = MEDIA_INPUT_KIND[kind]
            if stage not in deployed:
                raise StageUnavailable(
                    f"{where}.parts[{j}]: {kind} input needs the '{stage}' stage, which is not deployed",
                    retryable=False,
                )
            item: omni_pb2.Media = getattr(part, kind)
            source = item.WhichOneof("source")
            if source is None:
                raise InvalidRequest(f"{where}.parts[{j}].{kind}: set data or path")
            if source == "data" and not item.data:
                raise InvalidRequest(f"{where}.parts[{j}].{kind}.data: empty")
            content.append(MediaSlot(kind, len(media)))
            media.append(MediaPart(f"{where}.parts[{j}].{kind}", kind, item))
            continue
        if not part.text:
            raise InvalidRequest(f"{where}.parts[{j}].text: empty text (give it text or leave the part out)")
        if content and isinstance(content[-1], str):
            content[-1] += part.text
        else:
            content.append(part.text)
    if msg.role == omni_pb2.ROLE_TOOL and any(not isinstance(c, str) for c in content):
        raise InvalidRequest(f"{where}.parts: a tool message takes text only")
    return (*content, *calls)


def plan_raw(req: omni_pb2.GenerateRequest, request_id: str, limits: RequestLimits) -> PlannedRequest:
    """A raw-prompt request (GenerateRequest.prompt or prompt_token_ids): text in, text out, nothing else."""
    if req.prompt and req.prompt_token_ids:
        raise InvalidRequest("prompt_token_ids: not with prompt (one raw prompt, as text or as ids)")
    if len(req.prompt_token_ids) > limits.max_prompt_chars:  # the wire walk refuses these before decoding
        raise InvalidRequest(
            f"prompt_token_ids: {len(req.prompt_token_ids)} ids, the limit is {limits.max_prompt_chars} "
            "(max_prompt_chars)"
        )
    for name in ("messages", "tools"):
        if getattr(req, name):
            raise InvalidRequest(f"{name}: not with prompt (a raw prompt is the whole input)")
    if req.system_prompt:
        raise InvalidRequest("system_prompt: not with prompt (a raw prompt has no chat format)")
    if set(req.output_modalities) - {omni_pb2.MODALITY_TEXT}:
        raise InvalidRequest("output_modalities: a raw prompt answers with text only")
    if len(req.prompt) > limits.max_prompt_chars:
        raise InvalidRequest(
            f"prompt: {len(req.prompt)} characters, the limit is {limits.max_prompt_chars} (max_prompt_chars)"
        )
    check_sampling(req.sampling)
    outputs = frozenset({omni_pb2.MODALITY_TEXT})
    return PlannedRequest(
        request_id,
        (),
        "",
        req.sampling,
        outputs,
        prompt_chars=len(req.prompt),
        raw=req.prompt,
        raw_ids=tuple(req.prompt_token_ids),
    )


def _messages(
    req: omni_pb2.GenerateRequest, deployed: set[str], limits: RequestLimits
) -> tuple[str, list[Turn], list[MediaPart]]:
    """The request's system prompt, its turns and media parts, each message checked (roles, order,
    content) and the prompt's characters counted as they add up."""
    system_prompt = req.system_prompt
    turns: list[Turn] = []
    media: list[MediaPart] = []
    text_chars = len(system_prompt)
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if msg.role == omni_pb2.ROLE_SYSTEM:
            if i != 0:
                raise InvalidRequest(f"{where}.role: a system message may only be the first message")
            if system_prompt:
                raise InvalidRequest(f"{where}.role: system_prompt and a system message are both set")
        elif msg.role == omni_pb2.ROLE_TOOL:
            if (
                not turns
                or turns[-1].role not in ("tool", "assistant")
                or (turns[-1].role == "assistant" and not req.messages[i - 1].tool_calls)
            ):
                raise InvalidRequest(
                    f"{where}.role: a tool message must follow an assistant message with tool_calls"
                )
        elif msg.role not in (omni_pb2.ROLE_USER, omni_pb2.ROLE_ASSISTANT):
            raise InvalidRequest(f"{where}.role: must be ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT or ROLE_TOOL")
        content = _message_content(where, msg, deployed, media)
        text_chars += sum(
            len(c) if isinstance(c, str) else len(c.name) + len(c.arguments)
            for c in content
            if isinstance(c, str | ToolCallPart)
        )
        if text_chars > limits.max_prompt_chars:
            raise InvalidRequest(
                f"messages: the prompt passes {limits.max_prompt_chars} characters at {where} (max_prompt_chars)"
            )
        if msg.role == omni_pb2.ROLE_SYSTEM:
            if len(content) != 1 or not isinstance(content[0], str):
                raise InvalidRequest(f"{where}.parts: a system message takes text only")
            system_prompt = content[0]
        else:
            turns.append(Turn(_TURN_ROLE[msg.role], content))
    return system_prompt, turns, media


def plan_request(
    req: omni_pb2.GenerateRequest,
    deployed: set[str],
    default_system_prompt: str,
    limits: RequestLimits,
    *,
    output_kinds: dict[int, str] | None = None,
) -> PlannedRequest:
    """Validate `req` against the deployed stages and limits; raise InvalidRequest / StageUnavailable.
    `output_kinds`: output modality → the stage kind that makes it (default: the stage table's)."""
    check_counts(req, limits)
    request_id = req.request_id or uuid.uuid4().hex
    if not valid_request_id(request_id):
        raise InvalidRequest(f"request_id: must be printable and at most {MAX_REQUEST_ID_CHARS} characters")
    if req.prompt or req.prompt_token_ids:
        return plan_raw(req, request_id, limits)
    if not req.messages:
        raise InvalidRequest("messages: at least one message (or a prompt) is required")
    outputs = _check_outputs(req, deployed, OUTPUT_STAGE if output_kinds is None else output_kinds)
    system_prompt, turns, media = _messages(req, deployed, limits)
    if not turns or turns[-1].role not in ("user", "tool"):
        raise InvalidRequest("messages: the last message must be from ROLE_USER (or ROLE_TOOL)")
    check_sampling(req.sampling)  # the values' shape; against the thinker's max_model_len: check_context
    tools = plan_tools(req, outputs)
    sampling = req.sampling
    if tools is not None:  # the thinker keeps `<tool_call>` (a special token) for ToolEvents to find
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(req.sampling)
        sampling.keep_special_tokens = True
        if tools.forced:
            sampling.constraint.CopyFrom(tools.constraint())
    system_prompt = system_prompt or default_system_prompt or DEFAULT_SYSTEM_PROMPT
    # Media placeholders are not counted: their token counts come from the encoder, and the
    # thinker bounds the prompt's tokens.
    chars = prompt_chars(_chat(turns, system_prompt, tools, None))
    if chars > limits.max_prompt_chars:
        raise InvalidRequest(
            f"messages: the prompt has {chars} characters with its chat markup, the limit is "
            f"{limits.max_prompt_chars} (max_prompt_chars)"
        )
    return PlannedRequest(
        request_id, tuple(turns), system_prompt, sampling, frozenset(outputs), tuple(media), chars, tools
    )
