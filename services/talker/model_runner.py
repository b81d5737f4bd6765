"""TalkerRunner: the talker's model calls for a batch of streams (the only model-calling code of the
stage; the start-up stress runs the same methods): prefill, LM decode, the CFM sample and the VAE.
Its caches hold `slots` streams; its step graphs are made for at most `step_batch` rows."""

from __future__ import annotations

import torch
from omnistage.services.talker.models.audio_vae import DecodeStream
from omnistage.services.talker.models.dit import sway_times
from omnistage.services.talker.models.loader import TalkerModels
from omnistage.services.talker.models.prompt import PromptIds
from omnistage.services.talker.models.qwen2 import KVSlots, Rows
from omnistage.services.talker.step_graphs import StepGraphs
from omnistage.services.talker.voice_prompt import Voice


class TalkerRunner:
    def __init__(
        self,
        models: TalkerModels,
        slots: int,
        max_lm_tokens: int,
        max_vae_frames: int,
        *,
        temperature: float = 0.0,
        sigma: float = 0.25,
        graphs: bool = False,
        capture: bool | None = None,
        step_batch: int | None = None,
        prefill_widths: tuple[int, ...] = (),
    ) -> None:
        self.models = models
        self.config = models.config
        self.device, self.dtype = models.device, models.dtype
        self.slots = slots
        self.step_batch = min(step_batch or slots, slots)  # rows one step runs at most
        self.lm_cache = KVSlots(models.config.llm, slots, max_lm_tokens, dtype=self.dtype, device=self.device)
        self.vae_cache = models.vae.decoder.new_cache(
            slots, max_vae_frames, dtype=self.dtype, device=self.device
        )
        self.times = sway_times(models.config.steps)  # host tensor: step sizes are read without a device sync
        self.sde_scale = sigma * temperature**0.5
        cfg = self.config
        # Time embeddings, step sizes and rotary tables of every CFM sample, made once.
        self.plan = models.talker.dit.plan(self.times, cfg.history_patch_size, cfg.patch_size, self.device)
        self.static: StepGraphs | None = None
        if graphs:
            self.static = StepGraphs(
                models.talker,
                self.lm_cache,
                self.plan,
                cap=self.step_batch,
                history_len=cfg.history_patch_size,
                patch=cfg.patch_size,
                latent_dim=cfg.latent_dim,
                cfg_strength=cfg.cfg_strength,
                sde_scale=self.sde_scale,
                capture=torch.device(self.device).type == "cuda" if capture is None else capture,
                vae=(models.vae.decoder.decoder, self.vae_cache, cfg.patch_size * cfg.vae.patch_size),
                prefill_widths=prefill_widths,
            )

    @property
    def cache_bytes(self) -> int:
        return self.lm_cache.nbytes + self.vae_cache.nbytes

    @property
    def stream_bytes(self) -> int:
        """The caches one stream holds (its slot of the LM and VAE caches)."""
        return self.cache_bytes // (self.slots + 1)  # + the scratch slot padded rows write to

    # -- LM ------------------------------------------------------------------------------------

    def prompt_embeddings(self, prompt: PromptIds, voice: Voice) -> torch.Tensor:
        """[L, hidden]: token embeddings with the speaker vector and the voice prompt's patches spliced in."""
        ids = torch.tensor(prompt.ids, dtype=torch.long).to(self.device, non_blocking=True)
        x = self.models.talker.embed(ids)
        x[prompt.speaker_position] = voice.speaker.to(x.dtype)
        a = prompt.audio_position
        x[a : a + prompt.prompt_patches] = voice.embeddings.to(x.dtype)
        return x

    @torch.no_grad()
    def prefill(self, slot: int, embeddings: torch.Tensor) -> torch.Tensor:
        """Whole prompt of one request into its slot → the last hidden state [hidden]."""
        rows = Rows.of([slot], [0], [embeddings.shape[0]], self.device)
        return self.models.talker.model(embeddings[None], self.lm_cache, rows)[0, -1]

    @torch.no_grad()
    def prefill_batch(self, slots: list[int], embeddings: list[torch.Tensor]) -> torch.Tensor:
        """Several whole prompts in one forward (right-padded; padding goes to the scratch slot) → each
        prompt's last hidden state [n, hidden]; on the step graphs where their lengths fit a bucket."""
        if self.static is not None and (out := self.static.prefill(slots, embeddings)) is not None:
            return out
        lengths = [e.shape[0] for e in embeddings]
        if len(embeddings) == 1:
            return self.prefill(slots[0], embeddings[0])[None]
        x = torch.nn.utils.rnn.pad_sequence(embeddings, batch_first=True)
        rows = Rows.of(slots, [0] * len(slots), lengths, self.device)
        out = self.models.talker.model(x, self.lm_cache, rows)
        return out[torch.arange(len(slots), device=out.device), torch.tensor(lengths, device=out.device) - 1]

    @torch.no_grad()
    def decode(self, slots: list[int], positions: list[int], inputs: torch.Tensor) -> torch.Tensor:
        """One new input per row [B, hidden] at `positions` → hidden states [B, hidden]."""
        if self.static is not None:
            return self.static.decode(slots, positions, inputs)
        rows = Rows.of(slots, positions, [1] * len(slots), self.device)
        return self.models.talker.model(inputs[:, None], self.lm_cache, rows)[:, 0]

    # -- CFM, aggregator, stop head --------------------------------------------------------------

    @torch.no_grad()
    def sample(
        self, hidden: torch.Tensor, history: torch.Tensor, generators: list[torch.Generator]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows' hidden [B, hidden] + history [B, H, C] → (patch [B, P, C] float32, next LM inputs [B, hidden],
        stop probability [B]). Each row's noise comes from its own generator (batched == alone)."""
        cfg = self.config
        shape = (cfg.patch_size, cfg.latent_dim)
        noise = torch.stack([torch.randn(shape, generator=g, device=self.device) for g in generators])
        sde = None
        if self.sde_scale:
            sde = torch.stack(
                [torch.randn((cfg.steps, *shape), generator=g, device=self.device) for g in generators], dim=1
            )
        if self.static is not None:
            return self.static.sample(hidden, history, noise, sde)
        talker = self.models.talker
        patch = talker.dit.sample_planned(
            self.plan, hidden, history, noise, cfg.cfg_strength, sde, self.sde_scale
        )
        return patch, talker.aggregator(patch), talker.stop_probability(hidden)

    # -- VAE -------------------------------------------------------------------------------------

    def vae(
        self, streams: list[DecodeStream], latents: list[torch.Tensor], last: list[bool]
    ) -> list[torch.Tensor]:
        backbone = self.static.vae_backbone if self.static is not None else None
        return self.models.vae.decoder.decode_step(streams, latents, last, self.vae_cache, backbone)
