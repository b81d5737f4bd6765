"""Our Whisper-style audio encoder against transformers' `WhisperEncoder` on the tiny checkpoint (fp32).

transformers' encoder refuses any input but exactly 2 x max_source_positions mel frames (the 30 s
padding of Whisper). Ming's encoder runs un-padded with the sinusoid table sliced to the clip, so the
reference is built with max_source_positions = T' (the clip's length after conv2) and its learned
position table filled with the first T' rows of the checkpoint's table: the same un-padded path,
compared end to end. Names differ (query/key/value/out ↔ q/k/v/out_proj, attn_ln ↔
self_attn_layer_norm, mlp.0/2 ↔ fc1/fc2, mlp_ln ↔ final_layer_norm, ln_post ↔ layer_norm).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers  # a dev dependency: the reference must be there, never skipped
from omnistage.services.encoder.models.audio import audio_token_count


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _hf_whisper(cfg, raw, positions: int):
    hf_cfg = transformers.WhisperConfig(
        d_model=cfg.n_state,
        encoder_layers=cfg.n_layer,
        encoder_attention_heads=cfg.n_head,
        encoder_ffn_dim=4 * cfg.n_state,
        num_mel_bins=cfg.n_mels,
        max_source_positions=positions,
    )
    hf_cfg._attn_implementation = "eager"
    model = transformers.models.whisper.modeling_whisper.WhisperEncoder(hf_cfg).float().eval()
    names = {
        "attn.query": "self_attn.q_proj",
        "attn.key": "self_attn.k_proj",
        "attn.value": "self_attn.v_proj",
        "attn.out": "self_attn.out_proj",
        "attn_ln": "self_attn_layer_norm",
        "mlp.0": "fc1",
        "mlp.2": "fc2",
        "mlp_ln": "final_layer_norm",
    }
    state = {"embed_positions.weight": raw["audio.positional_embedding"][:positions]}
    for key, value in raw.items():
        if not key.startswith("audio.") or key == "audio.positional_embedding":
            continue
        name = key.removeprefix("audio.").replace("ln_post", "layer_norm")
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            module, leaf = rest.rsplit(".", 1)
            name = f"layers.{i}.{names[module]}.{leaf}"
        state[name] = value
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("frames", [40, 178])  # 0.4 s and 1.78 s of mel frames (even: T' = frames / 2)
def test_whisper_encoder_matches_transformers_unpadded(frames, tiny_encoders, raw_tensors):
    cfg = tiny_encoders.config.audio
    mel = torch.randn(1, cfg.n_mels, frames, generator=torch.Generator().manual_seed(frames))
    hf = _hf_whisper(cfg, raw_tensors, frames // 2)
    with torch.inference_mode():
        ref = hf(mel).last_hidden_state
        ours, lengths = tiny_encoders.audio.audio(mel, torch.tensor([frames]))
    assert ours.shape == ref.shape == (1, frames // 2, cfg.n_state) and lengths.tolist() == [frames // 2]
    assert _rel(ours, ref) <= 1e-5


def test_projector_conv_gelu_linear_and_l2_norm(tiny_encoders, raw_tensors):
    cfg = tiny_encoders.config.audio
    mel = torch.randn(1, cfg.n_mels, 101, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        hidden, _ = tiny_encoders.audio.audio(mel, torch.tensor([101]))
        x = F.conv1d(
            hidden.transpose(1, 2),
            raw_tensors["linear_proj_audio.0.weight"],
            raw_tensors["linear_proj_audio.0.bias"],
            stride=2,
            padding=1,
        )
        x = F.linear(
            F.gelu(x.transpose(1, 2)),
            raw_tensors["linear_proj_audio.3.weight"],
            raw_tensors["linear_proj_audio.3.bias"],
        )
        ref = F.normalize(x, dim=-1)[0]
        (ours,) = tiny_encoders.audio.encode_items([mel[0]])
    assert ours.shape[0] == audio_token_count(101) == 26
    assert _rel(ours, ref) <= 1e-5


def test_a_clip_encodes_the_same_alone_and_batched_with_longer_clips(tiny_encoders):
    """Padding is masked: odd lengths exercise the conv edges, a longer partner the attention mask."""
    cfg = tiny_encoders.config.audio
    gen = torch.Generator().manual_seed(7)
    clips = [torch.randn(cfg.n_mels, n, generator=gen) for n in (37, 160, 81)]
    alone = [tiny_encoders.audio.encode_items([c])[0] for c in clips]
    batched = tiny_encoders.audio.encode_items(clips)
    for c, a, b in zip(clips, alone, batched, strict=True):
        assert a.shape == b.shape == (audio_token_count(c.shape[1]), cfg.projector_size)
        assert torch.allclose(a, b, atol=2e-6)
