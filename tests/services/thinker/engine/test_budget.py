"""A request's budget is computed once where the request is made: the default max_tokens clamped to
what fits, hidden-state requests generate nothing, the context rule's message when it cannot fit."""

from __future__ import annotations

import pytest
from omnistage.services.thinker.engine.budget import RequestBudget, RequestError


def test_the_default_max_tokens_is_clamped_to_what_fits():
    assert RequestBudget.of(10, 0, 64, 256) == RequestBudget(10, 54, 64)
    assert RequestBudget.of(10, 0, 1024, 256) == RequestBudget(10, 256, 1024)
    assert RequestBudget.of(10, 20, 64, 256) == RequestBudget(10, 20, 64)


def test_a_hidden_state_request_generates_nothing_and_may_fill_the_context():
    assert RequestBudget.of(300, 0, 300, 256, hidden_states=True) == RequestBudget(300, 0, 300)
    with pytest.raises(RequestError, match="^prompt with the image query block: 301 token"):
        RequestBudget.of(301, 0, 300, 256, hidden_states=True)


@pytest.mark.parametrize(
    "prompt, max_tokens, message",
    [
        (0, 0, "prompt: empty after tokenization"),
        (64, 0, "prompt: 64 token(s) leave no room to generate (max_model_len 64)"),
        (2, 63, "sampling.max_tokens: 63 + a prompt of 2 token(s) exceeds max_model_len 64"),
    ],
)
def test_what_cannot_fit_is_refused_with_the_context_rules_message(prompt, max_tokens, message):
    with pytest.raises(RequestError) as err:
        RequestBudget.of(prompt, max_tokens, 64, 256)
    assert str(err.value) == message


def test_the_engine_asserts_a_budget_it_can_hold():
    budget = RequestBudget.of(10, 20, 64, 256)
    assert budget.holds(10, 64) and budget.holds(10, 128)
    assert not budget.holds(11, 64)  # another prompt's
    assert not budget.holds(10, 32)  # a larger context than the engine's
