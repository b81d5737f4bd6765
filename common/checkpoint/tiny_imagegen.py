"""The image-generation part of the tiny Ming checkpoint (ming.md §6.4), in the release's layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omnistage.common.checkpoint.part_shapes import autoencoder_kl_shape, qwen2_shape, zimage_dit_shape
from safetensors.torch import save_file

QUERY_SCALE = 16
CAP_DIM = 40

TINY_CONNECTOR = qwen2_shape(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=128,
)

TINY_DIT = zimage_dit_shape(
    dim=96,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    cap_feat_dim=CAP_DIM,
    axes_dims=[16, 16, 16],
)

TINY_VAE = autoencoder_kl_shape(block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4)

SCHEDULER: dict[str, Any] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


class _Tensors:
    """Seeded random tensors under their checkpoint names (linear std 0.02, norms around 1)."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen
        self.out: dict[str, torch.Tensor] = {}

    def normal(self, name: str, *shape: int, std: float = 0.02, mean: float = 0.0) -> None:
        self.out[name] = torch.randn(*shape, generator=self.gen) * std + mean

    def linear(self, name: str, out_f: int, in_f: int, bias: bool = True) -> None:
        self.normal(name + ".weight", out_f, in_f)
        if bias:
            self.normal(name + ".bias", out_f)

    def norm(self, name: str, n: int, bias: bool = False) -> None:
        self.normal(name + ".weight", n, std=0.05, mean=1.0)
        if bias:
            self.normal(name + ".bias", n)

    def conv(self, name: str, cout: int, cin: int, k: int) -> None:
        self.normal(name + ".weight", cout, cin, k, k, std=0.1)
        self.normal(name + ".bias", cout)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.to(torch.bfloat16).contiguous() for k, v in self.out.items()},
            str(path),
            metadata={"format": "pt"},
        )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _mlp(t: _Tensors, thinker_hidden: int) -> None:
    q = torch.randn(QUERY_SCALE**2, thinker_hidden, generator=t.gen)
    t.out[f"query_tokens_dict.{QUERY_SCALE}x{QUERY_SCALE}"] = torch.nn.functional.normalize(q, dim=-1)
    t.linear("proj_in", TINY_CONNECTOR["hidden_size"], thinker_hidden)
    t.linear("proj_out", CAP_DIM, TINY_CONNECTOR["hidden_size"])


def _connector(t: _Tensors) -> None:
    c = TINY_CONNECTOR
    h, i = c["hidden_size"], c["intermediate_size"]
    d = h // c["num_attention_heads"]
    t.normal("model.embed_tokens.weight", c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t.linear(p + "self_attn.q_proj", c["num_attention_heads"] * d, h)
        t.linear(p + "self_attn.k_proj", c["num_key_value_heads"] * d, h)
        t.linear(p + "self_attn.v_proj", c["num_key_value_heads"] * d, h)
        t.linear(p + "self_attn.o_proj", h, c["num_attention_heads"] * d, bias=False)
        t.linear(p + "mlp.gate_proj", i, h, bias=False)
        t.linear(p + "mlp.up_proj", i, h, bias=False)
        t.linear(p + "mlp.down_proj", h, i, bias=False)
        t.norm(p + "input_layernorm", h)
        t.norm(p + "post_attention_layernorm", h)
    t.norm("model.norm", h)


def _dit_block(t: _Tensors, p: str, dim: int, head_dim: int, modulation: bool) -> None:
    for proj in ("to_q", "to_k", "to_v", "to_out.0"):
        t.linear(p + f"attention.{proj}", dim, dim, bias=False)
    t.norm(p + "attention.norm_q", head_dim)
    t.norm(p + "attention.norm_k", head_dim)
    ffn = int(dim / 3 * 8)
    t.linear(p + "feed_forward.w1", ffn, dim, bias=False)
    t.linear(p + "feed_forward.w2", dim, ffn, bias=False)
    t.linear(p + "feed_forward.w3", ffn, dim, bias=False)
    for norm in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
        t.norm(p + norm, dim)
    if modulation:
        t.linear(p + "adaLN_modulation.0", 4 * dim, min(dim, 256))


def _dit(t: _Tensors) -> None:
    c = TINY_DIT
    dim, head_dim, patch = c["dim"], c["dim"] // c["n_heads"], 2 * 2 * c["in_channels"]
    adaln = min(dim, 256)
    t.linear("all_x_embedder.2-1", dim, patch)
    t.linear("all_final_layer.2-1.linear", patch, dim)
    t.linear("all_final_layer.2-1.adaLN_modulation.1", dim, adaln)
    for n in range(c["n_refiner_layers"]):
        _dit_block(t, f"noise_refiner.{n}.", dim, head_dim, modulation=True)
        _dit_block(t, f"context_refiner.{n}.", dim, head_dim, modulation=False)
    for n in range(c["n_layers"]):
        _dit_block(t, f"layers.{n}.", dim, head_dim, modulation=True)
    t.linear("t_embedder.mlp.0", 1024, 256)
    t.linear("t_embedder.mlp.2", adaln, 1024)
    t.norm("cap_embedder.0", c["cap_feat_dim"])
    t.linear("cap_embedder.1", dim, c["cap_feat_dim"])
    t.normal("x_pad_token", 1, dim)
    t.normal("cap_pad_token", 1, dim)


def _resnet(t: _Tensors, p: str, cin: int, cout: int) -> None:
    t.norm(p + "norm1", cin, bias=True)
    t.conv(p + "conv1", cout, cin, 3)
    t.norm(p + "norm2", cout, bias=True)
    t.conv(p + "conv2", cout, cout, 3)
    if cin != cout:
        t.conv(p + "conv_shortcut", cout, cin, 1)


def _mid(t: _Tensors, p: str, ch: int) -> None:
    _resnet(t, p + "resnets.0.", ch, ch)
    _resnet(t, p + "resnets.1.", ch, ch)
    t.norm(p + "attentions.0.group_norm", ch, bias=True)
    for proj in ("to_q", "to_k", "to_v", "to_out.0"):
        t.linear(p + f"attentions.0.{proj}", ch, ch)


def _vae(t: _Tensors) -> None:
    c = TINY_VAE
    ch, layers, latent = c["block_out_channels"], c["layers_per_block"], c["latent_channels"]
    t.conv("encoder.conv_in", ch[0], c["in_channels"], 3)
    for i, cout in enumerate(ch):
        cin = ch[max(i - 1, 0)]
        for j in range(layers):
            _resnet(t, f"encoder.down_blocks.{i}.resnets.{j}.", cin if j == 0 else cout, cout)
        if i < len(ch) - 1:
            t.conv(f"encoder.down_blocks.{i}.downsamplers.0.conv", cout, cout, 3)
    _mid(t, "encoder.mid_block.", ch[-1])
    t.norm("encoder.conv_norm_out", ch[-1], bias=True)
    t.conv("encoder.conv_out", 2 * latent, ch[-1], 3)
    rev = list(reversed(ch))
    t.conv("decoder.conv_in", rev[0], latent, 3)
    _mid(t, "decoder.mid_block.", rev[0])
    for i, cout in enumerate(rev):
        cin = rev[max(i - 1, 0)]
        for j in range(layers + 1):
            _resnet(t, f"decoder.up_blocks.{i}.resnets.{j}.", cin if j == 0 else cout, cout)
        if i < len(rev) - 1:
            t.conv(f"decoder.up_blocks.{i}.upsamplers.0.conv", cout, cout, 3)
    t.norm("decoder.conv_norm_out", rev[-1], bias=True)
    t.conv("decoder.conv_out", c["out_channels"], rev[-1], 3)


def imagegen_configs(
    *, connector: dict[str, Any], dit: dict[str, Any], vae: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """The image-generation config files (path under the checkpoint → JSON) for these part shapes
    (ming.md §6.4); the conditioning width is the DiT's `cap_feat_dim`."""
    mlp = {
        "dit_type": "zimage",
        "img_gen_scales": [QUERY_SCALE],
        "diffusion_c_input_dim": dit["cap_feat_dim"],
        "text_encoder_norm": True,
        "use_identity_mlp": True,
    }
    qwen2 = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
        **connector,
    }
    return {
        "mlp/config.json": mlp,
        "connector/config.json": qwen2,
        "transformer/config.json": {"_class_name": "ZImageTransformer2DModel", **dit},
        "vae/config.json": {"_class_name": "AutoencoderKL", **vae},
        "scheduler/scheduler_config.json": SCHEDULER,
    }


def write_imagegen_configs(
    out: Path, *, connector: dict[str, Any], dit: dict[str, Any], vae: dict[str, Any]
) -> None:
    """Write the config files of mlp/, connector/, transformer/, vae/ and scheduler/ under `out`."""
    for rel, config in imagegen_configs(connector=connector, dit=dit, vae=vae).items():
        _write_json(out / rel, config)


def write_tiny_imagegen(out: Path, *, thinker_hidden: int, seed: int = 0) -> None:
    """Write mlp/, connector/, transformer/, vae/ and scheduler/ (configs and weights) under the checkpoint folder `out`."""
    gen = torch.Generator().manual_seed(seed + 7_000)
    write_imagegen_configs(out, connector=TINY_CONNECTOR, dit=TINY_DIT, vae=TINY_VAE)
    for folder, name, fill in (
        ("mlp", "model.safetensors", lambda t: _mlp(t, thinker_hidden)),
        ("connector", "model.safetensors", _connector),
        ("transformer", "diffusion_pytorch_model.safetensors", _dit),
        ("vae", "diffusion_pytorch_model.safetensors", _vae),
    ):
        tensors = _Tensors(gen)
        fill(tensors)
        tensors.save(out / folder / name)
