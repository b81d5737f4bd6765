"""The config keys of each part of a Ming checkpoint besides the thinker, one builder per part.

A builder takes the sizes a shape chooses and fills in what the architecture fixes (activation,
patch sizes, block types, the VAE's factors), in the key order of the release's config files. The
release's shapes (release_shapes.py) and the tiny ones (tiny.py, tiny_talker.py, tiny_imagegen.py)
are calls of these, so a part's keys are spelled once and the two can differ only in their sizes.
"""

from __future__ import annotations

from typing import Any


def vision_shape(
    *,
    depth: int,
    hidden_size: int,
    num_heads: int,
    intermediate_size: int,
    num_position_embeddings: int,
    out_hidden_size: int,
    deepstack_visual_indexes: list[int],
) -> dict[str, Any]:
    """The Qwen3-VL-style ViT's `vision_config` (ming.md §3.1): patch 16 x 16 x 2 frames, merge 2 x 2."""
    return {
        "depth": depth,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
        "hidden_act": "gelu_pytorch_tanh",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "in_channels": 3,
        "spatial_merge_size": 2,
        "num_position_embeddings": num_position_embeddings,
        "out_hidden_size": out_hidden_size,
        "deepstack_visual_indexes": deepstack_visual_indexes,
    }


def whisper_shape(*, n_ctx: int, n_state: int, n_head: int, n_layer: int) -> dict[str, Any]:
    """openai-whisper's AudioEncoder dims (ming.md §4.1): 128 mel bins, as large-v3."""
    return {"n_mels": 128, "n_ctx": n_ctx, "n_state": n_state, "n_head": n_head, "n_layer": n_layer}


def qwen2_shape(
    *,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    **more: Any,
) -> dict[str, Any]:
    """The sizes of a Qwen2 config (talker LM, AudioVAE backbones, image connector); `more`: further
    keys of that config (vocab_size, a sliding window), after the sizes."""
    return {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        **more,
    }


def cfm_dit_shape(*, hidden_size: int, depth: int, num_heads: int) -> dict[str, Any]:
    """The talker's CFM DiT and aggregator blocks (ming.md §5.1): MLP ratio 4."""
    return {"hidden_size": hidden_size, "depth": depth, "num_heads": num_heads, "mlp_ratio": 4.0}


def zimage_dit_shape(
    *,
    dim: int,
    n_layers: int,
    n_refiner_layers: int,
    n_heads: int,
    n_kv_heads: int,
    cap_feat_dim: int,
    axes_dims: list[int],
) -> dict[str, Any]:
    """The Z-Image DiT's `transformer/config.json` (ming.md §6.2): 2 x 2 patches of 16 latent channels."""
    return {
        "all_patch_size": [2],
        "all_f_patch_size": [1],
        "in_channels": 16,
        "dim": dim,
        "n_layers": n_layers,
        "n_refiner_layers": n_refiner_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "norm_eps": 1e-5,
        "qk_norm": True,
        "cap_feat_dim": cap_feat_dim,
        "rope_theta": 256.0,
        "t_scale": 1000.0,
        "axes_dims": axes_dims,
        "axes_lens": [1024, 512, 512],
    }


def autoencoder_kl_shape(
    *, block_out_channels: list[int], layers_per_block: int, norm_num_groups: int
) -> dict[str, Any]:
    """The Flux / Z-Image 16-channel AutoencoderKL's `vae/config.json` (ming.md §6.3): four blocks
    (8x spatial factor); its scaling and shift factors (the release's file is unconfirmed, ming.md §9)."""
    return {
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 16,
        "block_out_channels": block_out_channels,
        "layers_per_block": layers_per_block,
        "norm_num_groups": norm_num_groups,
        "act_fn": "silu",
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "mid_block_add_attention": True,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "scaling_factor": 0.3611,
        "shift_factor": 0.1159,
        "sample_size": 1024,
        "force_upcast": True,
    }
