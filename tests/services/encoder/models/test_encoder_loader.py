"""The encoder loader: names and shapes checked up front, a release-like fp32 vision tower loads into
bf16 without a full-precision copy, and the placeholder ids come from the checkpoint's config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omnistage.common.checkpoint.shards import CheckpointError, iter_tensors, shard_files, write_sharded
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.encoder.models.loader import is_encoder_key, load_encoders


def _variant(src: Path, dst: Path, edit) -> Path:
    """A copy of the tiny checkpoint whose tensors went through `edit(dict)`."""
    tensors = {k: v for shard in shard_files(src) for k, v in iter_tensors(shard)}
    edit(tensors)
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json" and not f.name.endswith("index.json"):
            shutil.copy(f, dst / f.name)
    write_sharded(tensors, dst, 3)
    return dst


def test_placeholder_ids_come_from_the_checkpoint(tiny_ckpt, tiny_encoders):
    llm = json.loads((tiny_ckpt / "config.json").read_text())["llm_config"]
    added = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    by_name = {v["content"]: int(k) for k, v in added.items()}
    ph = tiny_encoders.config.placeholders
    assert ph.image_patch == llm["image_patch_token"] == by_name["<imagePatch>"]
    assert ph.video_patch == llm["video_patch_token"] == by_name["<framePatch>"]
    assert ph.audio_patch == by_name["<audioPatch>"]


def test_every_encoder_key_of_the_tiny_checkpoint_is_loaded_or_a_deepstack_merger(tiny_ckpt, tiny_encoders):
    keys = {k for shard in shard_files(tiny_ckpt) for k, _ in iter_tensors(shard) if is_encoder_key(k)}
    ours = set(tiny_encoders.vision.state_dict()) | set(tiny_encoders.audio.state_dict())
    assert ours <= keys
    assert all(".deepstack_merger_list." in k for k in keys - ours)


def test_a_mismatched_checkpoint_fails_naming_every_bad_key(tiny_ckpt, tmp_path):
    def edit(t: dict) -> None:
        del t["vision.blocks.1.attn.qkv.bias"]
        del t["vision.deepstack_merger_list.0.norm.weight"]
        t["audio.conv1.weight"] = torch.zeros(64, 80, 3, dtype=torch.bfloat16)
        t["audio.extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)

    bad = _variant(tiny_ckpt, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as err:
        load_encoders(bad, dtype=torch.float32, device="cpu")
    msg = str(err.value)
    assert "missing keys: vision.blocks.1.attn.qkv.bias, vision.deepstack_merger_list.0.norm.weight" in msg
    assert "unexpected keys: audio.extra.weight" in msg
    assert "mis-shaped keys: audio.conv1.weight [64, 80, 3] != [64, 128, 3]" in msg


def test_fp32_stored_vision_loads_into_bf16_without_a_full_precision_copy(tiny_ckpt, tmp_path):
    """The release stores the vision tower in fp32; bf16 serving must not build it in fp32 first."""

    def to_fp32(t: dict) -> None:
        for k in list(t):
            if k.startswith(("vision.", "linear_proj.")):
                t[k] = t[k].float()

    release_like = _variant(tiny_ckpt, tmp_path / "fp32-vision", to_fp32)
    stored = {
        k: v for shard in shard_files(release_like) for k, v in iter_tensors(shard) if is_encoder_key(k)
    }
    mem = SimulatedDeviceMemory(1 << 34)
    with mem.meter():
        models = load_encoders(release_like, dtype=torch.bfloat16, device="cpu")
    tensors = [*models.vision.parameters(), *models.audio.parameters(), *models.audio.buffers()]
    assert all(t.dtype == torch.bfloat16 for t in tensors)
    weights = models.weights_bytes
    largest_stored = max(v.numel() * v.element_size() for v in stored.values())
    # Weights in bf16 plus the one checkpoint tensor being copied (fp32): never the tower in fp32.
    assert weights <= mem.peak_allocated() <= weights * 1.05 + largest_stored
    qkv = "vision.blocks.0.attn.qkv.weight"
    assert torch.equal(models.vision.state_dict()[qkv], stored[qkv].to(torch.bfloat16))
