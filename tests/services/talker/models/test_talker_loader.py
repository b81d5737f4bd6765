"""load_talker: configs from talker/, every key checked from the shard headers, dtype on load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omnistage.common.checkpoint.shards import CheckpointError, iter_tensors, shard_files, write_sharded
from omnistage.services.talker.models.loader import load_talker


def test_configs_and_dtypes_from_the_talker_folder(talker_ckpt, talker_models):
    cfg = talker_models.config
    assert (cfg.steps, cfg.patch_size, cfg.history_patch_size, cfg.cfg_strength) == (10, 4, 32, 2.0)
    assert cfg.vae.n_fft == 3528 and cfg.vae.samples_per_latent == 3528 and cfg.samples_per_step == 14112
    assert talker_models.vae.decoder.decoder.embed_tokens is None  # stored in the checkpoint, never used
    bf16 = load_talker(talker_ckpt, dtype=torch.bfloat16, device="cpu")
    assert bf16.talker.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert bf16.talker.dit.rotary_embed.inv_freq.dtype == torch.float32  # rotary tables stay float32
    assert bf16.vae.decoder.head.istft.window.dtype == torch.float32


def _rewrite(folder, edit) -> None:
    tensors = {k: v for shard in shard_files(folder) for k, v in iter_tensors(shard)}
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    edit(tensors)
    write_sharded(tensors, folder, 1)


@pytest.mark.parametrize(
    ("folder", "edit", "needle"),
    [
        ("talker", lambda t: t.pop("stop_head.weight"), "missing keys: stop_head.weight"),
        ("talker", lambda t: t.update({"extra.weight": torch.zeros(1)}), "unexpected keys: extra.weight"),
        (
            "talker/vae",
            lambda t: t.update({"decoder.fc1.bias": torch.zeros(3)}),
            "mis-shaped keys: decoder.fc1.bias [3]",
        ),
    ],
)
def test_a_wrong_checkpoint_fails_naming_the_keys(talker_ckpt, tmp_path, folder, edit, needle):
    root = tmp_path / "ckpt"
    shutil.copytree(talker_ckpt, root)
    _rewrite(root / folder, edit)
    with pytest.raises(CheckpointError, match="talker weights do not match") as err:
        load_talker(root, dtype=torch.float32, device="cpu")
    assert needle in str(err.value)


def test_a_missing_config_is_named(talker_ckpt, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(talker_ckpt, root)
    vae = json.loads((root / "talker/vae/config.json").read_text())
    del vae["dec_kwargs"]["output_dim"]
    (root / "talker/vae/config.json").write_text(json.dumps(vae))
    with pytest.raises(CheckpointError, match=r"vae/config.json dec_kwargs: lacks required keys output_dim"):
        load_talker(root, dtype=torch.float32, device="cpu")


def test_the_condition_width_is_the_lm_width(talker_ckpt, tmp_path):
    """The release's DiT reads `flowmodel.llm_cond_dim` (default 896): the tiny checkpoint writes its own
    width, and a config without it (or with another width) is refused by name, not mis-built."""
    top = json.loads((talker_ckpt / "talker/config.json").read_text())
    llm = json.loads((talker_ckpt / "talker/llm/config.json").read_text())
    assert top["flowmodel"]["llm_cond_dim"] == llm["hidden_size"] != 896
    root = tmp_path / "ckpt"
    shutil.copytree(talker_ckpt, root)
    del top["flowmodel"]["llm_cond_dim"]
    (root / "talker/config.json").write_text(json.dumps(top))
    with pytest.raises(CheckpointError, match=r"flowmodel llm_cond_dim 896 != talker LM hidden_size 64"):
        load_talker(root, dtype=torch.float32, device="cpu")
