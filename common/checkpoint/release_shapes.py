"""The sizes of every part of Ming-flash-omni-2.0 besides the thinker, as the release's config files
state them (ming.md §3.1, §4.1, §5.1, §6.2, §6.4), in those files' own keys.

One place for them: `make-config-checkpoint` writes them, the tests check the stages read them back.
The keys each part's architecture fixes are part_shapes.py's; here are the sizes.
Where ming.md marks a size unconfirmed, the value here is the one the benchmarks assume (noted).
"""

from __future__ import annotations

from typing import Any

from omnistage.common.checkpoint.part_shapes import (
    autoencoder_kl_shape,
    cfm_dit_shape,
    qwen2_shape,
    vision_shape,
    whisper_shape,
    zimage_dit_shape,
)

# Qwen3-VL-style ViT (ming.md §3.1): 27 x 1152, patch 16, 48 x 48 position table, out 4096.
VISION = vision_shape(
    depth=27,
    hidden_size=1152,
    num_heads=16,
    intermediate_size=4304,
    num_position_embeddings=2304,
    out_hidden_size=4096,
    deepstack_visual_indexes=[8, 16, 24],
)
# openai-whisper AudioEncoder at large-v3 size with n_ctx 15000 (ming.md §4.1).
WHISPER = whisper_shape(n_ctx=15000, n_state=1280, n_head=20, n_layer=32)
# Qwen2-0.5B (ming.md §5.1 [3p]) with Qwen2's vocabulary.
QWEN2_0_5B = qwen2_shape(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
)
# talker/llm: Qwen2-0.5B.
TALKER_LLM: dict[str, Any] = QWEN2_0_5B
# The CFM DiT and the aggregator (same block shape, ming.md §5.1; the aggregator's size is [unconf]).
TALKER_DIT = cfm_dit_shape(hidden_size=1024, depth=8, num_heads=16)
# AudioVAE backbones: [unconf] in ming.md §5.1; bench/talker_speech.py assumes Qwen2-0.5B for both.
AUDIO_VAE_BACKBONE: dict[str, Any] = QWEN2_0_5B
# connector/: Qwen2-1.5B run as a bidirectional encoder (ming.md §6.1 [3p]).
CONNECTOR = qwen2_shape(
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
    vocab_size=151936,
    max_position_embeddings=131072,
)
# transformer/: the default Z-Image 6B DiT (ming.md §6.2, [unconf]).
IMAGE_DIT = zimage_dit_shape(
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,
    n_heads=30,
    n_kv_heads=30,
    cap_feat_dim=2560,
    axes_dims=[32, 48, 48],
)
# vae/: the Flux / Z-Image 16-channel AutoencoderKL (ming.md §6.3, factors [unconf]).
IMAGE_VAE = autoencoder_kl_shape(
    block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32
)
