"""The context rule, once: a request's prompt and the tokens it may generate fit the thinker's context.

Every layer that can refuse a request for its length asks `context_violation` and sends its message:
the gateway (knowing a least prompt length, before admission), the thinker's request flow (a lower
bound before tokenizing, then the exact count) and the sampling rules (`max_tokens` alone). Below the
flow the engine only asserts what the flow computed (`RequestBudget`).
"""

from __future__ import annotations

from typing import Any

from omnistage.common.runtime.errors import CONTEXT_OVERFLOW, InvalidRequest


def context_violation(
    max_model_len: int,
    *,
    prompt_tokens: int = 0,
    max_tokens: int = 0,
    at_least: bool = False,
    where: str = "prompt",
    generates: bool = True,
) -> str | None:
    """Why a request of `prompt_tokens` (a lower bound when `at_least`) asking for `max_tokens` (0: the
    server's default) cannot fit `max_model_len`, as the client reads it; None when it can.

    `where` names the part of the request that holds the prompt's tokens (`prompt`, `multimodal`,
    `chat.pieces`); `generates` False: the prompt may fill the context (hidden-state mode samples
    nothing)."""
    if max_tokens > max_model_len:
        return f"sampling.max_tokens: {max_tokens} exceeds max_model_len {max_model_len}"
    size = f"{'at least ' if at_least else ''}{prompt_tokens} token(s)"
    if not generates:
        if prompt_tokens > max_model_len:
            return f"{where}: {size} exceed max_model_len {max_model_len}"
        return None
    if prompt_tokens >= max_model_len:
        return f"{where}: {size} leave no room to generate (max_model_len {max_model_len})"
    if max_tokens and prompt_tokens + max_tokens > max_model_len:
        return f"sampling.max_tokens: {max_tokens} + a prompt of {size} exceeds max_model_len {max_model_len}"
    return None


def violation_reason(max_model_len: int, max_tokens: int = 0) -> str:
    """A violation's kind (errors.py): CONTEXT_OVERFLOW where the prompt's length is part of it (a
    shorter prompt would fit: Converse forgets its oldest turns and retries), none where `max_tokens`
    alone exceeds the context."""
    return "" if max_tokens > max_model_len else CONTEXT_OVERFLOW


def check_context(max_model_len: int, **request: Any) -> None:
    """Raise InvalidRequest with `context_violation(max_model_len, **request)`'s message and its
    `violation_reason` when the request cannot fit (the same keywords)."""
    error = context_violation(max_model_len, **request)
    if error is not None:
        raise InvalidRequest(error, reason=violation_reason(max_model_len, request.get("max_tokens", 0)))
