"""Talker start-up work: stress-and-cap the number of streams speaking at once, and warm up."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import torch
from omnistage.common.config import TalkerConfig
from omnistage.common.memory.device import DeviceMemory
from omnistage.common.memory.stress import StressAndCap, StressResult
from omnistage.common.runtime.progress import Report
from omnistage.services.talker.models.audio_vae import DecodeStream, UpsampleState
from omnistage.services.talker.models.loader import TalkerModels
from omnistage.services.talker.runner import TalkerRunner
from omnistage.services.talker.session import Chunk, Finished, SpeakSession, StreamSettings, TextInput
from omnistage.services.talker.voice_prompt import CUSTOM, Voice
from omnistage.services.talker.voices import ReferenceClip, build_voice
from omnistage.v1 import control_pb2


@dataclass(frozen=True)
class CacheSizes:
    """Per-slot cache lengths the engine allocates: LM positions and VAE frames."""

    lm_tokens: int
    vae_frames: int

    @classmethod
    def of(cls, models: TalkerModels, cfg: TalkerConfig) -> CacheSizes:
        mc = models.config
        steps = math.ceil(cfg.max_segment_seconds * mc.vae.sample_rate / mc.samples_per_step)
        return cls(cfg.max_lm_tokens, steps * mc.patch_size * mc.vae.patch_size)


@dataclass
class Profile:
    stress: StressResult
    caches: CacheSizes

    @property
    def max_streams(self) -> int:
        return self.stress.max_batch

    def memory_report(
        self, mem: DeviceMemory, weights_bytes: int, cache_bytes: int, graph_pool_bytes: int = 0
    ) -> control_pb2.MemoryReport:
        return control_pb2.MemoryReport(
            device=mem.device_name,
            budget_bytes=self.stress.budget_bytes,
            weights_bytes=weights_bytes,
            kv_cache_bytes=cache_bytes,
            activation_peak_bytes=self.stress.activation_peak_bytes,
            graph_pool_bytes=graph_pool_bytes,
            total_bytes=mem.reserved(),
        )


def graphs_on(models: TalkerModels, cfg: TalkerConfig) -> bool:
    """Step graphs where they pay: `cuda_graphs` on a CUDA device (elsewhere the eager step)."""
    return cfg.cuda_graphs and torch.device(models.device).type == "cuda"


def _longest_prompt_voice(models: TalkerModels, cfg: TalkerConfig) -> tuple[Voice, str]:
    """A voice with the most prompt patches a custom clip may give, and the longest segment text."""
    mc = models.config
    samples_per_patch = mc.vae.enc_hop * mc.vae.patch_size * mc.patch_size
    patches = math.ceil(cfg.max_reference_seconds * mc.vae.sample_rate / samples_per_patch)
    hidden = mc.llm.hidden_size
    voice = Voice(
        CUSTOM,
        "word " * min(cfg.max_transcript_chars // 5, 100),
        torch.zeros(hidden, dtype=models.dtype, device=models.device),
        torch.zeros(patches * mc.patch_size, mc.latent_dim, device=models.device),
        torch.zeros(patches, hidden, dtype=models.dtype, device=models.device),
    )
    return voice, "word " * cfg.max_segment_length


def run_stress_batch(
    models: TalkerModels, cfg: TalkerConfig, caches: CacheSizes, batch: int, speaker_dim: int
) -> None:
    """Everything `batch` streams can hold and run at once (see the module docstring)."""
    mc = models.config
    runner = TalkerRunner(
        models,
        batch,
        caches.lm_tokens,
        caches.vae_frames,
        temperature=cfg.temperature,
        sigma=cfg.sigma,
        graphs=graphs_on(models, cfg),
    )
    voice, text = _longest_prompt_voice(models, cfg)
    prompt = models.prompt.build(text, voice.prompt_text, voice.patches)
    if len(prompt.ids) >= caches.lm_tokens:
        raise ValueError(
            f"talker.max_lm_tokens {caches.lm_tokens} leaves no room after the longest prompt "
            f"({len(prompt.ids)} tokens): raise it or lower max_reference_seconds / max_segment_length"
        )
    x = runner.prompt_embeddings(prompt, voice)
    hidden = runner.prefill_batch(list(range(batch)), [x] * batch)  # the engine prefills new streams together
    hidden = runner.decode(list(range(batch)), [caches.lm_tokens - 1] * batch, hidden)
    history = torch.zeros(batch, mc.history_patch_size, mc.latent_dim, device=runner.device)
    gens = [torch.Generator(runner.device).manual_seed(i) for i in range(batch)]
    patches, _, _ = runner.sample(hidden, history, gens)
    latents_so_far = caches.vae_frames // mc.vae.patch_size - mc.patch_size
    h = models.vae.decoder.fc1.out_features
    streams = [
        DecodeStream(
            slot,
            UpsampleState(
                torch.zeros(h, dtype=runner.dtype, device=runner.device),
                latents_so_far,
                mc.vae.patch_size * latents_so_far - 2,
            ),
        )
        for slot in range(batch)
    ]
    for s in streams:
        s.ola.frames = s.upsample.frames
    runner.vae(streams, list(patches), [False] * batch)
    if runner.static is not None:
        runner.static.capture_all()  # the graphs' memory pool is part of what `batch` streams need
    samples = int(cfg.max_reference_seconds * mc.vae.sample_rate)
    clip = ReferenceClip(
        np.zeros(samples, np.float32), np.zeros(0, np.float32), np.zeros(speaker_dim, np.float32)
    )
    build_voice(models, CUSTOM, "x", clip, None)


def profile(
    models: TalkerModels, mem: DeviceMemory, cfg: TalkerConfig, budget: int, report: Report, speaker_dim: int
) -> Profile:
    """Stress-and-cap the streams on `mem` within `budget` bytes (0: none); call inside `mem.meter()`."""
    caches = CacheSizes.of(models, cfg)

    def run(batch: int) -> None:
        report(
            "profiling_memory",
            f"{batch} streams: caches of {caches.lm_tokens} LM tokens and "
            f"{caches.vae_frames} VAE frames each, prefill + one step",
        )
        run_stress_batch(models, cfg, caches, batch, speaker_dim)

    return Profile(
        StressAndCap("talker", mem, run, cfg.stress_batch_sizes, budget_bytes=budget).run(), caches
    )


WARMUP_TEXT = "Hello, this is a warm-up. 你好。"


async def warm_up(session: SpeakSession) -> None:
    """One short stream through the whole path; its audio must be finite and non-empty."""

    async def inputs() -> AsyncIterator[TextInput]:
        yield TextInput(WARMUP_TEXT, end_of_text=True)

    chunks: list[bytes] = []
    finished = None
    async for event in session.run(StreamSettings("warm-up", seed=0), inputs()):
        if isinstance(event, Chunk):
            chunks.append(event.pcm16)
        elif isinstance(event, Finished):
            finished = event
    if finished is None or not chunks or finished.total_samples == 0:
        raise RuntimeError(f"talker warm-up produced no audio ({len(chunks)} chunks)")
