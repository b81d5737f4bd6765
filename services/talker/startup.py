"""Talker start-up work: the step batch by stress-and-cap, the streams speaking at once by what their
caches cost within the memory budget (ARCHITECTURE §7b), and the warm-up."""

from __future__ import annotations

import gc
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import torch
from omnistage.common.config import TalkerConfig
from omnistage.common.memory.device import DeviceMemory
from omnistage.common.memory.stress import StressAndCap, StressResult
from omnistage.common.memory.units import fmt_bytes
from omnistage.common.runtime.progress import Report
from omnistage.services.talker.model_runner import TalkerRunner
from omnistage.services.talker.models.audio_vae import DecodeStream, UpsampleState
from omnistage.services.talker.models.loader import TalkerModels
from omnistage.services.talker.models.qwen2 import KVSlots
from omnistage.services.talker.request_flow import Chunk, Finished, StreamSettings, TalkerEngine, TextInput
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
    """The step batch the stress proved (`stress.max_batch`) and the streams whose caches fit beside it."""

    stress: StressResult
    caches: CacheSizes
    stream_bytes: int  # the caches one stream holds
    max_streams: int

    @property
    def step_batch(self) -> int:
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


def stream_bytes(models: TalkerModels, caches: CacheSizes) -> int:
    """The caches one stream holds: its slot of the LM's KV and of the VAE decoder's (shapes on the
    meta device: counted, not allocated)."""
    one = [
        KVSlots(models.config.llm, 0, caches.lm_tokens, dtype=models.dtype, device="meta"),
        models.vae.decoder.new_cache(0, caches.vae_frames, dtype=models.dtype, device="meta"),
    ]
    return sum(c.nbytes for c in one)


def streams_that_fit(step_batch: int, peak: int, budget: int, per_stream: int, most: int) -> int:
    """The step batch's streams (inside the stress peak) plus as many more as the budget holds beyond
    that peak; `most` bounds it (and is the answer without a budget)."""
    if not budget:
        return max(most, step_batch)
    more = max(budget - peak, 0) // max(per_stream, 1)
    return max(min(step_batch + more, most), step_batch)


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


def new_runner(
    models: TalkerModels, cfg: TalkerConfig, caches: CacheSizes, slots: int, step_batch: int
) -> TalkerRunner:
    return TalkerRunner(
        models,
        slots,
        caches.lm_tokens,
        caches.vae_frames,
        temperature=cfg.temperature,
        sigma=cfg.sigma,
        graphs=graphs_on(models, cfg),
        step_batch=step_batch,
        prefill_widths=cfg.prefill_graph_tokens,
    )


def run_stress_batch(
    models: TalkerModels, cfg: TalkerConfig, caches: CacheSizes, batch: int, speaker_dim: int
) -> None:
    """Everything a step of `batch` streams holds and runs (their caches included)."""
    exercise(new_runner(models, cfg, caches, batch, batch), models, cfg, caches, batch, speaker_dim)


def exercise(
    runner: TalkerRunner,
    models: TalkerModels,
    cfg: TalkerConfig,
    caches: CacheSizes,
    batch: int,
    speaker_dim: int,
) -> None:
    """The largest step `runner` can take: `batch` longest prompts prefilled together, a decode at the
    cache's end, a CFM sample, a VAE step at the longest segment's end, the graphs, a custom voice."""
    mc = models.config
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
        runner.static.capture_all()  # the graphs' memory pool is part of what the step needs
    samples = int(cfg.max_reference_seconds * mc.vae.sample_rate)
    clip = ReferenceClip(
        np.zeros(samples, np.float32), np.zeros(0, np.float32), np.zeros(speaker_dim, np.float32)
    )
    build_voice(models, CUSTOM, "x", clip, None)


def profile(
    models: TalkerModels,
    mem: DeviceMemory,
    cfg: TalkerConfig,
    budget: int,
    report: Report,
    speaker_dim: int,
    full: bool = True,
) -> Profile:
    """Stress-and-cap the step batch on `mem` within `budget` bytes (0: none), then the stream cap from
    what one stream's caches cost; call inside `mem.meter()`.

    Not `full` (a plain CPU: no graphs to capture, no device memory to prove; `Boot.full_warmup`): the
    largest step batch is taken without a run (`StressAndCap.take_largest`), all the full stress can
    conclude there; `build_runner` runs that largest step once on the serving runner anyway."""
    caches = CacheSizes.of(models, cfg)

    def run(batch: int) -> None:
        report(
            "profiling_memory",
            f"a step of {batch} streams: caches of {caches.lm_tokens} LM tokens and "
            f"{caches.vae_frames} VAE frames each, prefill + one step",
        )
        run_stress_batch(models, cfg, caches, batch, speaker_dim)

    stress_and_cap = StressAndCap("talker", mem, run, cfg.stress_batch_sizes, budget_bytes=budget)
    stress = stress_and_cap.run() if full else stress_and_cap.take_largest()
    per_stream = stream_bytes(models, caches)
    streams = streams_that_fit(stress.max_batch, stress.peak_reserved, budget, per_stream, cfg.max_streams)
    return Profile(stress, caches, per_stream, streams)


def build_runner(
    models: TalkerModels,
    mem: DeviceMemory,
    cfg: TalkerConfig,
    prof: Profile,
    budget: int,
    report: Report,
    speaker_dim: int,
) -> tuple[TalkerRunner, int]:
    """The serving runner: `prof.max_streams` slots, graphs for `prof.step_batch` rows. Its largest step
    is run once and its peak measured (returned with its graph pool's bytes); over the budget, the streams the overshoot costs are taken off
    and it is built again (at most 3 times; `prof.max_streams` follows). Call inside `mem.meter()`."""
    for _ in range(3):
        report(
            "profiling_memory",
            f"caches of {prof.max_streams} streams ({fmt_bytes(prof.stream_bytes)} each), "
            f"steps of at most {prof.step_batch}",
        )
        gc.collect()
        mem.empty_cache()  # the stress's cached blocks back: the bigger caches are new tensors
        mem.reset_peak()
        runner = new_runner(models, cfg, prof.caches, prof.max_streams, prof.step_batch)
        before = mem.reserved()
        if runner.static is not None:
            report("profiling_memory", f"capturing {runner.static.capture_all()} step graphs")
        graph_pool = max(mem.reserved() - before, 0)
        exercise(runner, models, cfg, prof.caches, prof.step_batch, speaker_dim)
        over = mem.peak_reserved() - budget if budget else 0
        if over <= 0:
            return runner, graph_pool
        if prof.max_streams <= prof.step_batch:
            break
        del runner
        prof.max_streams = max(prof.max_streams - over // max(prof.stream_bytes, 1) - 1, prof.step_batch)
    raise RuntimeError(
        f"talker: {prof.max_streams} streams with steps of {prof.step_batch} peak over the budget of "
        f"{fmt_bytes(budget)} (lower talker.stress_batch_sizes or talker.max_streams, or raise the budget)"
    )


WARMUP_TEXT = "Hello, this is a warm-up. 你好。"  # two segments: up to 11 s of audio
# A plain CPU's warm-up: one segment (up to 2.5 s of audio) proves the same path; nothing is built there.
MINIMAL_WARMUP_TEXT = "Hi. 你好。"


async def warm_up(engine: TalkerEngine, full: bool = True) -> None:
    """One short stream through the whole path; its audio must be finite and non-empty (not `full`, a
    plain CPU's, `Boot.full_warmup`: one segment)."""
    text = WARMUP_TEXT if full else MINIMAL_WARMUP_TEXT

    async def inputs() -> AsyncIterator[TextInput]:
        yield TextInput(text, end_of_text=True)

    chunks: list[bytes] = []
    finished = None
    async for event in engine.speak(StreamSettings("warm-up", seed=0), inputs()):
        if isinstance(event, Chunk):
            chunks.append(event.pcm16)
        elif isinstance(event, Finished):
            finished = event
    if finished is None or not chunks or finished.total_samples == 0:
        raise RuntimeError(f"talker warm-up produced no audio ({len(chunks)} chunks)")
