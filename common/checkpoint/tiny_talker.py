"""Writes the tiny talker in the release's `talker/` layout (ming.md §5.1, §5.6), next to the tiny thinker."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omnistage.common.checkpoint.part_shapes import cfm_dit_shape, qwen2_shape
from omnistage.common.checkpoint.seeded import SeededInit
from omnistage.common.checkpoint.shards import write_sharded
from omnistage.common.checkpoint.tiny_tokenizer import CORPUS, added_tokens_decoder, train_byte_bpe
from omnistage.common.wav import wav_bytes

SAMPLE_RATE = 44100
LATENT_DIM = 64
SPK_DIM = 192
FBANK_BINS = 80

TALKER_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<audio>",
    "<audioPatch>",
    "</audio>",
)
TALKER_CORPUS = (
    CORPUS
    + """\
Please generate speech based on the following description.
You are a helpful assistant. Text input: speaker_1: speaker_2:
感谢你的认可。很高兴认识你。Nice to meet you. Thank you for listening.
"""
)

TINY_TALKER_LLM = qwen2_shape(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
)
TINY_DIT = cfm_dit_shape(hidden_size=64, depth=2, num_heads=4)
TINY_VAE_ENCODER = qwen2_shape(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    vocab_size=16,
)
# The encoder's backbone with 2 layers, layer 1 seeing the last 24 frames only: the streaming decode is
# tested across the window edge.
TINY_VAE_DECODER = {
    **TINY_VAE_ENCODER,
    "num_hidden_layers": 2,
    "use_sliding_window": True,
    "sliding_window": 24,
    "max_window_layers": 1,
}
VOICES: dict[str, tuple[str, float, tuple[float, ...]]] = {
    # name: (prompt text, seconds, partial frequencies in Hz)
    "DB30": ("感谢你的认可。", 0.9, (180.0, 360.0, 540.0)),
    "lingguang": ("Nice to meet you.", 1.3, (230.0, 460.0, 920.0)),
}


def _qwen2_config(shape: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2Model"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        "tie_word_embeddings": True,
        **shape,
        **extra,
    }


def _qwen2_tensors(
    init: SeededInit, prefix: str, c: dict[str, Any], with_embeddings: bool
) -> dict[str, torch.Tensor]:
    h = c["hidden_size"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    t: dict[str, torch.Tensor] = {}
    if with_embeddings:
        t[prefix + "embed_tokens.weight"] = init.normal(c["vocab_size"], h, std=1.0)
    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        t[p + "input_layernorm.weight"] = init.norm(h)
        t[p + "post_attention_layernorm.weight"] = init.norm(h)
        init.linear(t, p + "self_attn.q_proj", c["num_attention_heads"] * hd, h)
        init.linear(t, p + "self_attn.k_proj", kv, h)
        init.linear(t, p + "self_attn.v_proj", kv, h)
        init.linear(t, p + "self_attn.o_proj", h, c["num_attention_heads"] * hd, bias=False)
        init.linear(t, p + "mlp.gate_proj", c["intermediate_size"], h, bias=False)
        init.linear(t, p + "mlp.up_proj", c["intermediate_size"], h, bias=False)
        init.linear(t, p + "mlp.down_proj", h, c["intermediate_size"], bias=False)
    t[prefix + "norm.weight"] = init.norm(h)
    return t


def _dit_blocks(init: SeededInit, prefix: str, c: dict[str, Any]) -> dict[str, torch.Tensor]:
    d = c["hidden_size"]
    inner = int(d * c["mlp_ratio"])
    head_dim = d // c["num_heads"]
    t: dict[str, torch.Tensor] = {
        prefix + "rotary_embed.inv_freq": 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    }
    init.linear(t, prefix + "x_embedder", d, LATENT_DIM)
    for i in range(c["depth"]):
        b = f"{prefix}blocks.{i}."
        t[b + "norm1.weight"] = init.norm(d)
        t[b + "norm2.weight"] = init.norm(d)
        for name in ("to_q", "to_k", "to_v", "to_out.0"):
            init.linear(t, b + "attn." + name, d, d)
        init.linear(t, b + "mlp.ff.0.0", inner, d)
        init.linear(t, b + "mlp.ff.2", d, inner)
    t[prefix + "final_layer.norm_final.weight"] = init.norm(d)
    return t


def _talker_tensors(init: SeededInit, llm: dict[str, Any]) -> dict[str, torch.Tensor]:
    h = llm["hidden_size"]
    d = TINY_DIT["hidden_size"]
    t = _qwen2_tensors(init, "model.", llm, with_embeddings=True)
    f = _dit_blocks(init, "cfm.model.", TINY_DIT)
    init.linear(f, "cfm.model.t_embedder.time_mlp.0", d, 256)
    init.linear(f, "cfm.model.t_embedder.time_mlp.2", d, d)
    init.linear(f, "cfm.model.c_embedder.cond_embedder", d, h)
    init.linear(f, "cfm.model.final_layer.linear", LATENT_DIM, d, std=0.2)
    a = _dit_blocks(init, "aggregator.", TINY_DIT)
    a["aggregator.word_embedder.weight"] = init.normal(1, d)
    init.linear(a, "aggregator.final_layer.linear", h, d, std=0.2)
    heads: dict[str, torch.Tensor] = {}
    init.linear(heads, "stop_head", 2, h, std=0.2)
    init.linear(heads, "spk_head", h, SPK_DIM)
    return {**t, **f, **a, **heads}


def _vae_tensors(init: SeededInit, hop: int) -> dict[str, torch.Tensor]:
    e, d = TINY_VAE_ENCODER, TINY_VAE_DECODER
    he, hd = e["hidden_size"], d["hidden_size"]
    t: dict[str, torch.Tensor] = {}
    init.linear(t, "encoder.fc1", he, hop, bias=False, std=0.5)
    init.linear(t, "encoder.fc2", he, he)
    init.linear(t, "encoder.fc3", 2 * LATENT_DIM, he, std=0.2)
    t["encoder.norm.weight"] = init.norm(he)
    t["encoder.norm.bias"] = init.normal(he)
    t["encoder.cls_embed"] = init.normal(1, 1, he)
    t |= _qwen2_tensors(init, "encoder.encoder.", e, with_embeddings=True)
    t |= _qwen2_tensors(init, "encoder.aggregator.", {**e, "num_hidden_layers": 4}, with_embeddings=True)
    init.linear(t, "decoder.fc1", hd, LATENT_DIM, std=0.2)
    t |= _qwen2_tensors(init, "decoder.decoder.", d, with_embeddings=True)
    init.linear(t, "decoder.head.out", 4 * hop + 2, hd, std=0.05)
    t["decoder.head.out.bias"][: 2 * hop + 1] += 1.0  # log-magnitude around e: clearly audible, no clipping
    t["decoder.head.istft.window"] = torch.hann_window(4 * hop)
    return t


def write_campplus_onnx(path: Path, seed: int) -> None:
    """A two-MatMul graph with CAM++'s signature: fbank [1, T, 80] → [1, 192]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array((rng.standard_normal((FBANK_BINS, 32)) * 0.1).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((32, SPK_DIM)) * 0.3).astype(np.float32), "w2")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["feats", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("ReduceMean", ["r"], ["pooled"], axes=[1], keepdims=0),
            helper.make_node("MatMul", ["pooled", "w2"], ["embs"]),
        ],
        "campplus_tiny",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["batch", "frames", FBANK_BINS])],
        [helper.make_tensor_value_info("embs", TensorProto.FLOAT, ["batch", SPK_DIM])],
        initializer=[w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="omnistage")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())


def write_voice_wav(path: Path, seconds: float, partials: tuple[float, ...], seed: int) -> None:
    """A voiced-sounding PCM16 mono clip: harmonics with vibrato under a syllable envelope, plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    vibrato = 1 + 0.02 * np.sin(2 * math.pi * 5 * t)
    sig = sum(np.sin(2 * math.pi * f * vibrato * t) / (k + 1) for k, f in enumerate(partials))
    envelope = (
        0.5 * (1 - np.cos(2 * math.pi * 3 * t)) * np.minimum(1, 10 * t) * np.minimum(1, 10 * (seconds - t))
    )
    x = 0.3 * sig * envelope + 0.003 * rng.standard_normal(t.shape)
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(wav_bytes(pcm.tobytes(), SAMPLE_RATE))


def _write_tokenizer(llm_dir: Path) -> int:
    tok = train_byte_bpe(TALKER_CORPUS, TALKER_SPECIAL_TOKENS)
    tok.save(str(llm_dir / "tokenizer.json"))
    config = {
        "added_tokens_decoder": added_tokens_decoder({t: tok.token_to_id(t) for t in TALKER_SPECIAL_TOKENS}),
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 32768,
        "tokenizer_class": "Qwen2Tokenizer",
        "clean_up_tokenization_spaces": False,
    }
    (llm_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return tok.get_vocab_size()


def talker_configs(
    llm: dict[str, Any], dit: dict[str, Any], vae_encoder: dict[str, Any], vae_decoder: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """The three talker config files (path under `talker/` → JSON) for these part shapes (ming.md §5.1)."""
    hop = SAMPLE_RATE // 50
    top = {
        "architectures": ["BailingTalker2"],
        "steps": 10,
        "patch_size": 4,
        "history_patch_size": 32,
        "cfg_strength": 2.0,
        "latent_dim": LATENT_DIM,
        "spk_dim": SPK_DIM,
        "flowmodel": {**dit, "in_channels": LATENT_DIM, "dropout": 0.0, "llm_cond_dim": llm["hidden_size"]},
        "aggregator": {**dit, "in_channels": LATENT_DIM, "dropout": 0.1},
    }
    vae = {
        "sample_rate": SAMPLE_RATE,
        "patch_size": 4,
        "init_method": "kaiming",
        "enc_kwargs": {
            "input_dim": hop,
            "hop_size": hop,
            "latent_dim": LATENT_DIM,
            "backbone": _qwen2_config(vae_encoder),
        },
        "dec_kwargs": {"output_dim": hop, "latent_dim": LATENT_DIM, "backbone": _qwen2_config(vae_decoder)},
    }
    return {"config.json": top, "llm/config.json": _qwen2_config(llm), "vae/config.json": vae}


def write_talker_files(
    root: str | Path,
    *,
    llm: dict[str, Any],
    dit: dict[str, Any],
    vae_encoder: dict[str, Any],
    vae_decoder: dict[str, Any],
    seed: int = 0,
) -> tuple[Path, dict[str, Any]]:
    """Everything of `<root>/talker/` but the weights: the configs, the LM's tokenizer, `campplus.onnx`
    and the preset voices. `llm` without `vocab_size` gets the tokenizer's size rounded up to 64.
    Returns the talker folder and the LM shape written."""
    tdir = Path(root) / "talker"
    (tdir / "llm").mkdir(parents=True, exist_ok=True)
    (tdir / "vae").mkdir(parents=True, exist_ok=True)
    tokens = _write_tokenizer(tdir / "llm")
    llm = {"vocab_size": -(-tokens // 64) * 64, **llm}
    if llm["vocab_size"] < tokens:
        raise ValueError(
            f"talker LM vocab_size {llm['vocab_size']} does not hold the tokenizer's {tokens} tokens"
        )
    for rel, config in talker_configs(llm, dit, vae_encoder, vae_decoder).items():
        (tdir / rel).write_text(json.dumps(config, indent=2) + "\n")
    write_campplus_onnx(tdir / "campplus.onnx", seed)
    voices = {}
    for i, (name, (text, seconds, partials)) in enumerate(VOICES.items()):
        rel = "data/spks/prompt.wav" if i == 0 else f"data/spks/{name}.wav"
        write_voice_wav(tdir / rel, seconds, partials, seed + i)
        voices[name] = {"prompt_text": text, "prompt_wav_path": rel}
    (tdir / "data" / "voice_name.json").write_text(json.dumps(voices, indent=2, ensure_ascii=False) + "\n")
    return tdir, llm


def write_tiny_talker(root: str | Path, *, seed: int = 0) -> Path:
    """Write `<root>/talker/` (root: the Ming checkpoint folder); returns the talker folder."""
    tdir, llm = write_talker_files(
        root,
        llm=TINY_TALKER_LLM,
        dit=TINY_DIT,
        vae_encoder=TINY_VAE_ENCODER,
        vae_decoder=TINY_VAE_DECODER,
        seed=seed,
    )
    init = SeededInit(seed + 1, linear_std=0.05)
    float32_keys = ("rotary_embed.inv_freq", "head.istft.window")

    def stored(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v if k.endswith(float32_keys) else v.to(torch.bfloat16) for k, v in tensors.items()}

    write_sharded(stored(_talker_tensors(init, llm)), tdir, 2)
    write_sharded(stored(_vae_tensors(init, SAMPLE_RATE // 50)), tdir / "vae", 1)
    return tdir
