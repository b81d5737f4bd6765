"""MingTokenizer on the tiny checkpoint: round trips, special tokens, ids read from the files."""

from __future__ import annotations

import json

import pytest
from omnistage.common.checkpoint.tiny_tokenizer import SPECIAL_TOKENS
from omnistage.services.thinker.models.tokenizer import MingTokenizer


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return MingTokenizer(tiny_ckpt)


def test_round_trip_english_chinese_and_specials(tok):
    text = (
        "<role>HUMAN</role>你好，世界！Describe <image><imagePatch></image> please.<|role_end|>"
        "<role>ASSISTANT</role>"
    )
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] == tok.token_id("<role>") and ids[-1] == tok.token_id("</role>")
    assert tok.token_id("<|role_end|>") in ids and tok.token_id("<imagePatch>") in ids
    plain = tok.decode(ids, skip_special_tokens=True)
    assert "<role>" not in plain and "你好，世界！" in plain and "HUMAN" in plain
    assert tok.decode(tok.encode("杭州的西湖 emoji ✓ 🚀")) == "杭州的西湖 emoji ✓ 🚀"


def test_special_ids_come_from_files(tok, tiny_ckpt, tiny_model):
    decoder = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    by_name = {v["content"]: int(k) for k, v in decoder.items()}
    assert list(by_name) == list(SPECIAL_TOKENS)
    assert tok.eos_token_id == by_name["<|role_end|>"] == tiny_model.config.eos_token_id
    assert tok.pad_token_id == by_name["<|role_end|>"]
    assert by_name["<|role_end|>"] in tok.stop_token_ids
    cfg = tiny_model.config
    assert cfg.pad_token_id == by_name["<|endoftext|>"]
    assert (
        cfg.image_patch_token_id == by_name["<imagePatch>"]
        and cfg.video_patch_token_id == by_name["<framePatch>"]
    )
    assert cfg.image_start_token_id == by_name["<image>"] and cfg.image_end_token_id == by_name["</image>"]
    assert (
        cfg.video_start_token_id == by_name["<video>"] and cfg.audio_patch_token_id == by_name["<audioPatch>"]
    )
    # Same relative order as the release (ids 156891..157178), consecutive after the BPE vocabulary.
    assert [by_name[t] for t in SPECIAL_TOKENS] == list(
        range(by_name[SPECIAL_TOKENS[0]], by_name["<tts>"] + 1)
    )
    assert tok.vocab_size == by_name["<tts>"] + 1 <= cfg.vocab_size
    with pytest.raises(KeyError, match="not in the tokenizer"):
        tok.token_id("<nope>")
