"""Config-only checkpoints for every stage: the release's sizes read back by each stage's config classes
(no weights), and `load_format: dummy` building each stage at the tiny size, in the target dtype, on
the device, without a float32 copy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omnistage.common.checkpoint.config_only import write_config_checkpoint
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.encoder.models.audio import AudioEncoder
from omnistage.services.encoder.models.config import EncoderModelConfig
from omnistage.services.encoder.models.loader import load_encoders
from omnistage.services.encoder.models.vision import VisionEncoder
from omnistage.services.encoder.runner import vision_forward
from omnistage.services.imagegen.models.config import ImageGenModelConfig
from omnistage.services.imagegen.models.connector import ConditionEncoder
from omnistage.services.imagegen.models.dit import ZImageDiT
from omnistage.services.imagegen.models.loader import load_imagegen
from omnistage.services.talker.models.audio_vae import AudioVAE
from omnistage.services.talker.models.config import TALKER_DIR, TalkerModelConfig
from omnistage.services.talker.models.loader import load_talker
from omnistage.services.talker.models.talker_lm import TalkerModel
from omnistage.services.talker.speaker import SpeakerEncoder
from omnistage.services.talker.voices import VoiceBank
from omnistage.services.thinker.models.config import ThinkerConfig
from torch import nn

from tests.services.thinker.models.test_loader_memory import ShapeRecorder


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_config_checkpoint(tmp_path_factory.mktemp("ming-flash"), "ming-flash")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_config_checkpoint(tmp_path_factory.mktemp("tiny-config"), "tiny")


def test_no_weight_file_is_written_anywhere(release):
    assert not [p for p in release.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt")]
    assert {p.name for p in release.iterdir()} >= {
        "config.json",
        "tokenizer.json",
        "talker",
        "mlp",
        "connector",
        "transformer",
        "vae",
        "scheduler",
    }


def test_the_encoders_read_the_release_sizes(release):
    cfg = EncoderModelConfig.from_checkpoint(release)
    v, a = cfg.vision, cfg.audio
    assert (v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.patch_size) == (
        27,
        1152,
        16,
        4304,
        16,
    )
    assert (v.num_position_embeddings, v.out_hidden_size, v.projector_size) == (2304, 4096, 4096)
    assert (a.n_mels, a.n_ctx, a.n_state, a.n_head, a.n_layer, a.projector_size) == (
        128,
        15000,
        1280,
        20,
        32,
        4096,
    )
    with torch.device("meta"):
        vision, audio = VisionEncoder(v), AudioEncoder(a)
    # ming.md §1: ViT 576 M with 120 M of unused deepstack mergers (not built), projector 33.6 M;
    # Whisper 635 M, its projector 32.5 M.
    assert 455e6 < _params(vision.vision) < 457e6 and 33.5e6 < _params(vision.linear_proj) < 33.6e6
    assert 634e6 < _params(audio.audio) < 636e6 and 32.4e6 < _params(audio.linear_proj_audio) < 32.6e6


def test_the_talker_reads_the_release_sizes(release):
    cfg = TalkerModelConfig.from_checkpoint(release)
    llm = cfg.llm
    assert (llm.hidden_size, llm.num_layers, llm.num_heads, llm.num_kv_heads, llm.vocab_size) == (
        896,
        24,
        14,
        2,
        151936,
    )
    assert (cfg.flow.hidden_size, cfg.flow.depth, cfg.flow.num_heads) == (
        1024,
        8,
        16,
    ) and cfg.aggregator == cfg.flow
    assert (cfg.vae.sample_rate, cfg.vae.dec_hop, cfg.vae.n_fft, cfg.samples_per_step) == (
        44100,
        882,
        3528,
        14112,
    )
    with torch.device("meta"):
        talker, vae = TalkerModel(cfg), AudioVAE(cfg.vae)
    assert 493e6 < _params(talker.model) < 495e6  # Qwen2-0.5B (ming.md §5.1)
    assert _params(talker.cfm) == 103_117_920 - 32  # ming.md's count includes the 32 rotary frequencies
    assert _params(vae) > 0
    assert (release / TALKER_DIR / "campplus.onnx").is_file()
    assert SpeakerEncoder(release / TALKER_DIR / "campplus.onnx").dim == 192


def test_image_generation_reads_the_release_sizes(release):
    cfg = ImageGenModelConfig.from_checkpoint(release)
    assert (cfg.dit.dim, cfg.dit.n_layers, cfg.dit.n_heads, cfg.dit.cap_feat_dim) == (3840, 30, 30, 2560)
    assert (cfg.connector.hidden_size, cfg.connector.num_hidden_layers, cfg.thinker_hidden) == (
        1536,
        28,
        4096,
    )
    assert (
        cfg.vae.block_out_channels == (128, 256, 512, 512) and cfg.vae.latent_channels == cfg.dit.in_channels
    )
    assert cfg.mlp.num_queries == 256 and cfg.scheduler.use_dynamic_shifting
    with torch.device("meta"):
        dit = ZImageDiT(cfg.dit)
        cond = ConditionEncoder(cfg.mlp, cfg.connector, cfg.thinker_hidden, cfg.dit.cap_feat_dim)
    assert 6.1e9 < _params(dit) < 6.2e9  # Z-Image 6 B (ming.md §6.2)
    assert 1.3e9 < _params(cond.connector) < 1.32e9  # Qwen2-1.5B without its token embeddings


def test_the_thinker_reads_the_release_size_beside_the_other_parts(release):
    cfg = ThinkerConfig.from_checkpoint(release)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts) == (4096, 32, 256)


def _load_dummy(load, path: Path, **kwargs):
    """`load(path, dummy=True)` in bf16 on CPU under a simulated device and a recorder of every tensor made."""
    mem, rec = SimulatedDeviceMemory(1 << 34), ShapeRecorder()
    with mem.meter(), rec:
        models = load(path, dtype=torch.bfloat16, device="cpu", dummy=True, **kwargs)
    return models, rec


def _assert_dummy(module: nn.Module, dtype: torch.dtype, rec: ShapeRecorder) -> None:
    params = dict(module.named_parameters())
    assert params and all(p.dtype == dtype and torch.isfinite(p).all() for p in params.values())
    shapes = {tuple(p.shape) for p in params.values()}
    assert not [s for s, dt in rec.tensors if dt == torch.float32 and s in shapes], (
        "fp32 copies of bf16 weights"
    )
    big = [p for n, p in params.items() if p.dim() > 1 and p.numel() > 4096]
    assert big and all(0.015 < float(p.float().std()) < 0.025 for p in big)


def test_dummy_encoders_at_the_tiny_size(tiny):
    steps = []
    models, rec = _load_dummy(load_encoders, tiny, progress=lambda d, t: steps.append((d, t)))
    assert steps == [(1, 2), (2, 2)]
    for tower in (models.vision, models.audio):
        _assert_dummy(tower, torch.bfloat16, rec)
    norms = [m for m in models.vision.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(bool((m.weight == 1).all() and (m.bias == 0).all()) for m in norms)
    pe = models.audio.audio.positional_embedding
    assert pe[0, 0] == 0 and pe[0, -1] == 1  # Whisper's [sin | cos] table at position 0
    (rows,) = vision_forward(models, [torch.randint(0, 256, (1, 64, 64, 3), dtype=torch.uint8)])
    assert rows.shape == (4, models.config.vision.projector_size) and torch.isfinite(rows.float()).all()


def test_dummy_talker_at_the_tiny_size_encodes_its_preset_voices(tiny):
    models, rec = _load_dummy(load_talker, tiny)
    for module in (models.talker, models.vae):
        _assert_dummy(module, torch.bfloat16, rec)
    bank = VoiceBank(models, SpeakerEncoder(tiny / TALKER_DIR / "campplus.onnx"), "DB30", 10.0)
    bank.load_presets(0)
    voice = bank.preset("DB30")
    assert (
        voice is not None
        and voice.patches > 0
        and voice.embeddings.shape[-1] == models.config.llm.hidden_size
    )
    assert torch.isfinite(voice.embeddings.float()).all() and torch.isfinite(voice.speaker.float()).all()


def test_dummy_image_generation_at_the_tiny_size(tiny):
    models, rec = _load_dummy(load_imagegen, tiny)
    for module in (models.cond, models.dit):
        _assert_dummy(module, torch.bfloat16, rec)
    assert models.config.thinker_hidden == ThinkerConfig.from_checkpoint(tiny).hidden_size
    assert (
        math.prod(models.cond.proj_in.weight.shape)
        == models.config.thinker_hidden * models.config.connector.hidden_size
    )
