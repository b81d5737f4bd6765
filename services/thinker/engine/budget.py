"""RequestBudget: a request's tokens within the context, computed once where the request is made.

The request flow (or a caller of `LLMEngine.generate`) computes it from the prompt's exact length; the
engine and the scheduler only assert it. The rule and its message are `common/context_rule.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.common.context_rule import context_violation, violation_reason


class RequestError(ValueError):
    """The request cannot be served as given (maps to INVALID_ARGUMENT; `reason`: its kind, errors.py)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RequestBudget:
    """What one request may take of the context: its prompt and the tokens it may generate."""

    prompt_tokens: int
    # What it may generate: the client's max_tokens, or the default clamped to what fits; 0 for a
    # hidden-state request (it samples nothing).
    max_tokens: int
    max_model_len: int

    @classmethod
    def of(
        cls,
        prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        default_max_tokens: int,
        *,
        hidden_states: bool = False,
    ) -> RequestBudget:
        """The budget of a prompt of `prompt_tokens` (the image query block included) asking for
        `max_tokens` (0: the default); RequestError with the context rule's message if it cannot fit."""
        if prompt_tokens < 1:
            raise RequestError("prompt: empty after tokenization")
        error = context_violation(
            max_model_len,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            where="prompt with the image query block" if hidden_states else "prompt",
            generates=not hidden_states,
        )
        if error is not None:
            raise RequestError(error, violation_reason(max_model_len, max_tokens))
        if hidden_states:
            return cls(prompt_tokens, 0, max_model_len)
        return cls(
            prompt_tokens, max_tokens or min(default_max_tokens, max_model_len - prompt_tokens), max_model_len
        )

    def holds(self, num_prompt: int, max_model_len: int) -> bool:
        """Whether this budget is one of a prompt of `num_prompt` tokens within an engine of
        `max_model_len` (what the engine asserts)."""
        return (
            self.prompt_tokens == num_prompt > 0
            and self.max_model_len <= max_model_len
            and self.prompt_tokens + self.max_tokens <= self.max_model_len
        )
