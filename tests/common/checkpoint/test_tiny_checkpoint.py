"""The tiny Ming checkpoint: deterministic bytes, the release's key names and layout, bf16 storage."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from omnistage.common.checkpoint import read_headers, shard_files, write_tiny_checkpoint
from omnistage.common.checkpoint.tiny import TINY_LLM
from safetensors import safe_open

# ming.md §2.4 (thinker), §3.3 (vision + projector), §4.4 (audio + projector), as patterns.
_L = r"model\.model\.layers\.\d+\."
KEY_PATTERNS = [
    r"model\.model\.word_embeddings\.weight",
    r"model\.model\.norm\.weight",
    r"model\.lm_head\.weight",
    _L + r"(input_layernorm|post_attention_layernorm)\.weight",
    _L + r"attention\.(query_key_value|q_norm|k_norm|dense)\.weight",
    _L + r"mlp\.(gate_proj|up_proj|down_proj)\.weight",
    _L + r"mlp\.(gate|image_gate|audio_gate)\.(weight|expert_bias)",
    _L + r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight",
    _L + r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight",
    r"vision\.patch_embed\.proj\.(weight|bias)",
    r"vision\.pos_embed\.weight",
    r"vision\.blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.linear_fc1|mlp\.linear_fc2)\.(weight|bias)",
    r"vision\.merger\.(norm|linear_fc1|linear_fc2)\.(weight|bias)",
    r"vision\.deepstack_merger_list\.\d\.(norm|linear_fc1|linear_fc2)\.(weight|bias)",
    r"linear_proj\.[02]\.(weight|bias)",
    r"audio\.conv[12]\.(weight|bias)",
    r"audio\.positional_embedding",
    r"audio\.blocks\.\d+\.attn\.(query|value|out)\.(weight|bias)",
    r"audio\.blocks\.\d+\.attn\.key\.weight",
    r"audio\.blocks\.\d+\.(attn_ln|mlp_ln|mlp\.0|mlp\.2)\.(weight|bias)",
    r"audio\.ln_post\.(weight|bias)",
    r"linear_proj_audio\.[03]\.(weight|bias)",
]


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (the talker/ folder included), by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_deterministic_per_seed_across_processes(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=0)
    code = "import sys; from omnistage.common.checkpoint import write_tiny_checkpoint as w; w(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], check=True, timeout=120)
    assert _files(a) == _files(tmp_path / "b")
    c = write_tiny_checkpoint(tmp_path / "c", seed=1)
    fa, fc = _files(a), _files(c)
    assert fa["tokenizer.json"] == fc["tokenizer.json"]
    assert fa["model-00001-of-00004.safetensors"] != fc["model-00001-of-00004.safetensors"]
    assert fa["talker/model-00001-of-00002.safetensors"] != fc["talker/model-00001-of-00002.safetensors"]
    assert (
        fa["transformer/diffusion_pytorch_model.safetensors"]
        != fc["transformer/diffusion_pytorch_model.safetensors"]
    )


def test_layout_keys_and_dtypes(tmp_path):
    root = write_tiny_checkpoint(tmp_path / "ckpt")
    names = {p.name for p in root.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    shards = shard_files(root)
    assert len(shards) >= 3
    headers = read_headers(shards)
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(headers)
    pattern = re.compile("|".join(f"(?:{p})" for p in KEY_PATTERNS))
    assert [k for k in headers if not pattern.fullmatch(k)] == []
    assert {i.dtype for i in headers.values()} == {"BF16"}
    for prefix in ("model.model.", "vision.", "audio.", "linear_proj.", "linear_proj_audio."):
        assert any(k.startswith(prefix) for k in headers), prefix
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["architectures"] == ["BailingMM2NativeForConditionalGeneration"]
    llm = cfg["llm_config"]
    assert llm["router_type"] == "MultiRouter" and llm["rope_scaling"]["type"] == "video_rope"
    assert llm["vocab_size"] % 64 == 0
    assert headers["model.lm_head.weight"].shape == (llm["vocab_size"], TINY_LLM["hidden_size"])
    assert "whisper_encoder_config" in cfg["audio_config"] and cfg["mlp_depth"] == 2
    # Three routers per MoE layer with non-zero expert biases.
    bias = [k for k in headers if k.endswith("expert_bias")]
    assert len(bias) == 3 * (TINY_LLM["num_hidden_layers"] - TINY_LLM["first_k_dense_replace"])
    with safe_open(str(headers[bias[0]].shard), "pt") as f:
        assert f.get_tensor(bias[0]).float().abs().max() > 0


def test_image_generation_layout(tmp_path):
    """ming.md §6.4: mlp/ (query embeddings, proj_in/out), connector/ (HF Qwen2), transformer/ and vae/
    (diffusers names), scheduler/ (tests/services/imagegen load it with its key checks)."""
    root = write_tiny_checkpoint(tmp_path / "ckpt")
    for folder, name in (
        ("mlp", "model.safetensors"),
        ("connector", "model.safetensors"),
        ("transformer", "diffusion_pytorch_model.safetensors"),
        ("vae", "diffusion_pytorch_model.safetensors"),
    ):
        assert (root / folder / "config.json").is_file() and (root / folder / name).is_file(), folder
    assert (
        json.loads((root / "scheduler" / "scheduler_config.json").read_text())["use_dynamic_shifting"] is True
    )
    with safe_open(str(root / "mlp" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {
            "query_tokens_dict.16x16",
            "proj_in.weight",
            "proj_in.bias",
            "proj_out.weight",
            "proj_out.bias",
        }
        assert f.get_slice("query_tokens_dict.16x16").get_shape() == [256, TINY_LLM["hidden_size"]]
    vae = json.loads((root / "vae" / "config.json").read_text())
    assert vae["latent_channels"] == 16 and len(vae["block_out_channels"]) == 4  # 8x spatial factor
    dit = json.loads((root / "transformer" / "config.json").read_text())
    assert sum(dit["axes_dims"]) == dit["dim"] // dit["n_heads"]
