"""The context rule's one message for every layer that refuses a request for its length (issue 42):
max_tokens alone past the context, a prompt that leaves no room, both together; a lower bound says so;
hidden-state mode may fill the context."""

from __future__ import annotations

import pytest
from omnistage.common.context_rule import check_context, context_violation
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.sampling import sampling_violation


def test_max_tokens_alone_past_the_context_is_named_first():
    assert context_violation(512, prompt_tokens=600, max_tokens=5000) == (
        "sampling.max_tokens: 5000 exceeds max_model_len 512"
    )


def test_a_prompt_that_leaves_no_room_names_the_part_that_holds_it():
    assert context_violation(512, prompt_tokens=512) == (
        "prompt: 512 token(s) leave no room to generate (max_model_len 512)"
    )
    assert context_violation(512, prompt_tokens=600, at_least=True, where="multimodal") == (
        "multimodal: at least 600 token(s) leave no room to generate (max_model_len 512)"
    )
    assert context_violation(512, prompt_tokens=511) is None


def test_prompt_and_max_tokens_together():
    assert context_violation(64, prompt_tokens=2, max_tokens=63) == (
        "sampling.max_tokens: 63 + a prompt of 2 token(s) exceeds max_model_len 64"
    )
    # The gateway's form: it knows only the least the prompt takes.
    assert context_violation(1024, prompt_tokens=1, max_tokens=1024, at_least=True) == (
        "sampling.max_tokens: 1024 + a prompt of at least 1 token(s) exceeds max_model_len 1024"
    )
    assert context_violation(64, prompt_tokens=2, max_tokens=62) is None
    assert context_violation(64, prompt_tokens=2, max_tokens=0) is None  # 0: the default, clamped


def test_a_prompt_that_generates_nothing_may_fill_the_context():
    assert context_violation(300, prompt_tokens=300, generates=False) is None
    assert context_violation(
        300, prompt_tokens=301, generates=False, where="prompt with the image query block"
    ) == ("prompt with the image query block: 301 token(s) exceed max_model_len 300")


def test_the_sampling_rules_and_check_context_say_the_same():
    message = "sampling.max_tokens: 2000 exceeds max_model_len 1024"
    values = {"temperature": 0.0, "top_p": 0.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 0.0}
    values |= {"presence_penalty": 0.0, "max_tokens": 2000, "logprobs": 0, "stop": (), "stop_token_ids": ()}
    assert sampling_violation(values, max_model_len=1024) == message
    with pytest.raises(InvalidRequest, match=f"^{message}$"):
        check_context(1024, max_tokens=2000)
