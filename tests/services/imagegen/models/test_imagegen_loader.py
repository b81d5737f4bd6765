"""load_imagegen: every folder's keys checked from the shard headers (missing, unexpected, mis-shaped
named), parameters materialised in the target dtype, the unused tensors never materialised."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omnistage.common.checkpoint.shards import CheckpointError, iter_tensors
from omnistage.services.imagegen.models.loader import load_imagegen
from safetensors.torch import save_file


@pytest.fixture()
def ckpt_copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst


def _rewrite(path, edit) -> None:
    tensors = dict(iter_tensors(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_loads_the_tiny_checkpoint_in_the_target_dtype(tiny_ckpt, tiny_models):
    cfg = tiny_models.config
    assert (
        cfg.thinker_hidden == 256
        and cfg.mlp.num_queries == 256
        and cfg.mlp.query_key == "query_tokens_dict.16x16"
    )
    assert cfg.scheduler.use_dynamic_shifting and cfg.vae.scale_factor == 8
    stored = dict(iter_tensors(tiny_ckpt / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert torch.equal(
        tiny_models.dit.layers[1].attention.to_q.weight, stored["layers.1.attention.to_q.weight"].float()
    )
    conn = dict(iter_tensors(tiny_ckpt / "connector" / "model.safetensors"))
    assert torch.equal(tiny_models.cond.connector.model.norm.weight, conn["model.norm.weight"].float())
    names = {n for n, _ in tiny_models.cond.named_parameters()}
    assert not any("embed_tokens" in n or "lm_head" in n or "query_tokens" in n for n in names)
    bf16 = load_imagegen(tiny_ckpt, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for m in (bf16.cond, bf16.dit, bf16.vae) for p in m.parameters()} == {torch.bfloat16}


def test_wrong_keys_and_shapes_are_named(ckpt_copy):
    def edit(t):
        del t["layers.0.feed_forward.w2.weight"]
        t["layers.0.extra.weight"] = torch.zeros(2)
        t["x_pad_token"] = torch.zeros(1, 95)

    _rewrite(ckpt_copy / "transformer" / "diffusion_pytorch_model.safetensors", edit)
    with pytest.raises(CheckpointError) as err:
        load_imagegen(ckpt_copy, dtype=torch.float32, device="cpu")
    msg = str(err.value)
    assert "transformer" in msg and "missing keys: layers.0.feed_forward.w2.weight" in msg
    assert "unexpected keys: layers.0.extra.weight" in msg and "x_pad_token [1, 95] != [1, 96]" in msg


def test_query_embeddings_are_checked(ckpt_copy):
    _rewrite(
        ckpt_copy / "mlp" / "model.safetensors",
        lambda t: t.__setitem__("query_tokens_dict.16x16", torch.zeros(255, 256)),
    )
    with pytest.raises(CheckpointError, match=r"query_tokens_dict.16x16 \[255, 256\] != \[256, 256\]"):
        load_imagegen(ckpt_copy, dtype=torch.float32, device="cpu")


def test_missing_folder_and_unsupported_config(ckpt_copy):
    cfg_path = ckpt_copy / "transformer" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "siglip_feat_dim": 1152}))
    with pytest.raises(CheckpointError, match="transformer/config.json: siglip_feat_dim"):
        load_imagegen(ckpt_copy, dtype=torch.float32, device="cpu")
    cfg_path.write_text(json.dumps(cfg))
    shutil.rmtree(ckpt_copy / "vae")
    with pytest.raises(CheckpointError, match="vae/config.json: missing"):
        load_imagegen(ckpt_copy, dtype=torch.float32, device="cpu")


def test_dummy_needs_only_the_configs(ckpt_copy):
    for p in ckpt_copy.rglob("*.safetensors"):
        p.unlink()
    models = load_imagegen(ckpt_copy, dtype=torch.float32, device="cpu", dummy=True)
    assert models.dit.layers[0].attention_norm1.weight.eq(1).all() and models.dit.x_pad_token.std() > 0
