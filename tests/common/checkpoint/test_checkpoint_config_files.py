"""A checkpoint's JSON configs: a missing, broken or incomplete file fails naming the file and who needs it."""

from __future__ import annotations

import json

import pytest
from omnistage.common.checkpoint.config_files import read_added_tokens, read_json, require_keys, take
from omnistage.common.checkpoint.shards import CheckpointError


def test_a_missing_file_names_who_needs_it(tmp_path):
    with pytest.raises(CheckpointError, match=r"vae/config.json: missing \(the talker needs it\)"):
        read_json(tmp_path / "vae" / "config.json", "the talker")


@pytest.mark.parametrize("text, message", [("{", "not valid JSON"), ("[1, 2]", "expected a JSON object")])
def test_a_broken_file_is_named(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        read_json(tmp_path / "config.json", "the thinker")


def test_missing_keys_are_listed_together():
    require_keys({"a": 1}, ("a",), "x")
    with pytest.raises(CheckpointError, match="x: lacks required keys b, c"):
        require_keys({"a": 1}, ("a", "b", "c"), "x")


def test_added_tokens_come_from_the_tokenizer_config_or_none(tmp_path):
    assert read_added_tokens(tmp_path) == {}
    decoder = {"7": {"content": "<image>"}, "9": {"content": "<audioPatch>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    assert read_added_tokens(tmp_path) == {"<image>": 7, "<audioPatch>": 9}


def test_take_gives_the_required_keys_and_the_optional_ones_present():
    d = {"depth": 2, "patch_size": 14, "other": 1}
    assert take(d, ("depth",), ("patch_size", "in_channels"), "v") == {"depth": 2, "patch_size": 14}
    with pytest.raises(CheckpointError, match="v: lacks required keys heads"):
        take(d, ("depth", "heads"), (), "v")
