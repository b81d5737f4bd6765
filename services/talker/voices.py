"""Voices: what the talker clones for each request (ming.md §5.2, §5.5)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omnistage.common.checkpoint.shards import CheckpointError
from omnistage.services.talker.models.loader import TalkerModels
from omnistage.services.talker.reference_audio import ClipError, decode_clip
from omnistage.services.talker.speaker import SpeakerEncoder
from omnistage.services.talker.voice_prompt import Voice

CAMPPLUS_RATE = 16000


@dataclass(frozen=True)
class ReferenceClip:
    """A decoded reference clip, ready for the device work."""

    at_vae_rate: np.ndarray
    at_16k: np.ndarray
    speaker_vector: np.ndarray  # CAM++ output [spk_dim]


def prepare_clip(data: bytes, speaker: SpeakerEncoder, vae_rate: int, max_seconds: float) -> ReferenceClip:
    """Decode both rates and run CAM++ (CPU); ClipError for a clip that cannot be used."""
    vae = decode_clip(data, vae_rate, max_seconds)
    low = decode_clip(data, CAMPPLUS_RATE, max_seconds)
    if float(np.abs(vae).max()) == 0.0:
        raise ClipError("the clip is silent")
    return ReferenceClip(vae, low, speaker(low))


@torch.no_grad()
def build_voice(
    models: TalkerModels, name: str, prompt_text: str, clip: ReferenceClip, generator: torch.Generator | None
) -> Voice:
    """The device part: VAE latents (a posterior sample from `generator`), aggregator embeddings, spk_head."""
    cfg = models.config
    device, dtype = models.device, models.dtype
    samples_per_patch = cfg.vae.enc_hop * cfg.vae.patch_size * cfg.patch_size
    wave = torch.from_numpy(clip.at_vae_rate).to(device)
    wave = torch.nn.functional.pad(
        wave, ((-wave.shape[0]) % samples_per_patch, 0)
    )  # left: the end stays aligned
    latents = models.vae.encoder.latents(wave[None], generator)[0]
    latents = latents[: latents.shape[0] // cfg.patch_size * cfg.patch_size]
    embeddings = models.talker.aggregator(latents.reshape(-1, cfg.patch_size, cfg.latent_dim))
    vector = torch.from_numpy(clip.speaker_vector).to(device, dtype)
    if vector.shape[0] != cfg.spk_dim:
        raise CheckpointError(
            f"campplus.onnx gives {vector.shape[0]}-d vectors, spk_head takes {cfg.spk_dim}"
        )
    return Voice(name, prompt_text, models.talker.spk_head(vector), latents.float(), embeddings)


def read_presets(talker_dir: Path) -> dict[str, tuple[str, Path]]:
    """voice name → (prompt text, wav path) from `data/voice_name.json`, in file order (the first is the default)."""
    path = talker_dir / "data" / "voice_name.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found (the preset voices)")
    out = {}
    for name, info in json.loads(path.read_text()).items():
        wav = Path(info.get("prompt_wav_path", ""))
        wav = wav if wav.is_absolute() else talker_dir / wav
        if not wav.is_file():
            raise CheckpointError(f"{path}: voice {name!r}: {wav} not found")
        out[name] = (str(info.get("prompt_text", "")), wav)
    if not out:
        raise CheckpointError(f"{path}: no voices")
    return out


class VoiceBank:
    """Preset voices (computed at start-up) and the helpers for custom ones."""

    def __init__(
        self, models: TalkerModels, speaker: SpeakerEncoder, default: str, max_reference_seconds: float
    ):
        self.models = models
        self.speaker = speaker
        self.max_reference_seconds = max_reference_seconds
        self.presets: dict[str, Voice] = {}
        self.default = default

    def load_presets(self, seed: int) -> None:
        """Encode every preset clip once (seeded posterior samples: the same voices on every start)."""
        generator = torch.Generator(self.models.device).manual_seed(seed)
        for name, (text, wav) in read_presets(self.models.talker_dir).items():
            try:
                clip = prepare_clip(wav.read_bytes(), self.speaker, self.models.config.vae.sample_rate, 600.0)
            except ClipError as exc:
                raise CheckpointError(f"voice {name!r}: {wav}: {exc}") from None
            self.presets[name] = build_voice(self.models, name, text, clip, generator)
        if not self.default:
            self.default = next(iter(self.presets))
        if self.default not in self.presets:
            raise CheckpointError(
                f"talker.default_voice {self.default!r} is not a preset (have: {', '.join(self.presets)})"
            )

    def preset(self, name: str) -> Voice | None:
        return self.presets.get(name or self.default)
