"""Special tokens in a generated answer over gRPC: left out of the text by default (as vLLM's
skip_special_tokens), kept when the request asks (SamplingParams.keep_special_tokens); the token ids
carry them either way. The model is scripted to generate a reserved token mid-answer."""

from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.models.tokenizer import MingTokenizer

from tests.services.thinker.test_thinker_server import chat, events_of, run, thinker


@pytest.fixture(scope="module")
def tok(tiny_ckpt) -> MingTokenizer:
    return MingTokenizer(tiny_ckpt)


def script(engine, ids: list[int]) -> None:
    """Each step's logits pick the next of `ids` (one request at a time)."""
    model = engine.runner.model
    real, steps = model.compute_logits, iter(ids)

    def compute_logits(rows):
        logits = torch.full_like(real(rows), -1e4)
        logits[:, next(steps)] = 0.0
        return logits

    model.compute_logits = compute_logits


def answer(events) -> tuple[str, list[int]]:
    deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
    return "".join(d.text for d in deltas), [i for d in deltas for i in d.token_ids]


@pytest.mark.parametrize("keep", [False, True])
def test_a_generated_special_token_is_in_the_ids_and_in_the_text_only_when_kept(tmp_path, tok, keep):
    reserved = tok.token_id("<|reserved_token_235|>")
    ids = [*tok.encode("Hi"), reserved, *tok.encode(" there")]

    async def scenario():
        async with thinker(tmp_path, tok) as t:
            script(t.engine, ids)
            request = chat("Hello", max_tokens=len(ids), keep_special_tokens=keep)
            text, got = answer(await events_of(t.stub, request))
            assert got == ids
            assert text == ("Hi<|reserved_token_235|> there" if keep else "Hi there")

    run(scenario())


@pytest.mark.parametrize("keep", [False, True])
def test_the_logprobs_bytes_of_the_chosen_tokens_join_to_the_text_either_way(tmp_path, tok, keep):
    reserved = tok.token_id("<|reserved_token_235|>")
    ids = [*tok.encode("Hi"), reserved, *tok.encode(" there")]

    async def scenario():
        async with thinker(tmp_path, tok) as t:
            script(t.engine, ids)
            request = chat("Hello", max_tokens=len(ids), keep_special_tokens=keep, logprobs=2)
            events = await events_of(t.stub, request)
            text, _ = answer(events)
            logprobs = [lp for e in events if e.WhichOneof("event") == "delta" for lp in e.delta.logprobs]
            assert [lp.token_id for lp in logprobs] == ids  # every token has its entry, the special one too
            assert b"".join(lp.token for lp in logprobs).decode() == text
            special = next(lp for lp in logprobs if lp.token_id == reserved)
            assert (special.token == b"<|reserved_token_235|>") is keep
            assert special.top_tokens[0] == special.token  # the chosen one is the likeliest, shown alike

    run(scenario())
