"""ImagePipeline: one request's denoising state and the batched step (ming.md §6.1–§6.3)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from omnistage.services.imagegen import images
from omnistage.services.imagegen.models.dit import FirstBlockCache
from omnistage.services.imagegen.models.loader import ImageGenModels
from omnistage.services.imagegen.models.scheduler import Schedule

PATCH = 2


@dataclass(frozen=True)
class GenerationSpec:
    """What one request asks for, validated: sizes in pixels, the decoded conditioning."""

    condition: torch.Tensor  # [num_queries, thinker_hidden] thinker final-norm hidden states (CPU, or a GPU)
    bucket: tuple[int, int]  # (height, width) the DiT generates at
    steps: int
    guidance_scale: float  # CFG runs only when > 1 (the reference pipeline's rule)
    seed: int
    reference: np.ndarray | None = None  # uint8 [bucket h, bucket w, 3] for an edit


@dataclass(eq=False)
class DenoiseState:
    """One request inside the denoising loop."""

    spec: GenerationSpec
    latents: torch.Tensor  # [1, C, h, w] float32
    caption: torch.Tensor  # [1, L, cap_feat_dim] model dtype
    reference: torch.Tensor | None  # [1, C, h, w] model dtype, or None
    schedule: Schedule
    step: int = 0
    forwards: int = field(default=0)
    # First-block cache state of its DiT rows (positive, negative), used when the pipeline's threshold > 0.
    block_cache: tuple[FirstBlockCache, FirstBlockCache] = field(
        default_factory=lambda: (FirstBlockCache(), FirstBlockCache())
    )

    @property
    def done(self) -> bool:
        return self.step >= self.schedule.steps

    @property
    def cfg(self) -> bool:
        return self.spec.guidance_scale > 1.0

    @property
    def shape_key(self) -> tuple[int, ...]:
        """States with equal keys can share a DiT forward: latent frames, size and caption length."""
        _, c, h, w = self.latents.shape
        return (2 if self.reference is not None else 1, c, h, w, self.caption.shape[1])


class ImagePipeline:
    """Connector + DiT + VAE of one device; every method is device work."""

    def __init__(
        self, models: ImageGenModels, device: str | torch.device, first_block_cache: float = 0.0
    ) -> None:
        self.models = models
        self.first_block_cache = first_block_cache  # threshold; 0 is off (the exact forward)
        self.device = torch.device(device)
        self.dtype = models.dit.dtype
        self.vae_factor = models.config.vae.scale_factor
        with torch.inference_mode():
            zeros = torch.zeros(
                1, 1, models.config.mlp.diffusion_c_input_dim, device=self.device, dtype=models.cond.dtype
            )
            self._negative_row = models.cond.caption(zeros).to(self.dtype)  # [1, 1, cap_feat_dim]

    @property
    def size_multiple(self) -> int:
        """Pixel sizes must be multiples of this (VAE factor × DiT patch: 16 for Z-Image)."""
        return self.vae_factor * PATCH

    def latent_size(self, bucket: tuple[int, int]) -> tuple[int, int]:
        return bucket[0] // self.vae_factor, bucket[1] // self.vae_factor

    def image_seq_len(self, bucket: tuple[int, int]) -> int:
        h, w = self.latent_size(bucket)
        return (h // PATCH) * (w // PATCH)

    @torch.inference_mode()
    def prepare(self, spec: GenerationSpec) -> DenoiseState:
        cond = self.models.cond
        hidden = spec.condition.to(self.device, cond.dtype).unsqueeze(0)
        caption = cond.caption(cond.condition(hidden)).to(self.dtype)
        h, w = self.latent_size(spec.bucket)
        gen = torch.Generator(device="cpu").manual_seed(spec.seed)
        noise = torch.randn((1, self.models.config.dit.in_channels, h, w), generator=gen, dtype=torch.float32)
        reference = None
        if spec.reference is not None:
            pixels = images.reference_tensor(spec.reference).to(self.device)
            reference = self.models.vae.encode(pixels).to(self.dtype)
        schedule = self.models.schedule(spec.steps, self.image_seq_len(spec.bucket))
        return DenoiseState(spec, noise.to(self.device), caption, reference, schedule)

    @torch.inference_mode()
    def step(self, states: list[DenoiseState]) -> tuple[int, int]:
        """One Euler step for each state (equal shape keys); returns (states moved, DiT rows run).

        A step whose sigma does not change (the reference's last step, sigma 0 → 0) moves nothing,
        so its forward is skipped: the latents are exactly what the reference computes.
        """
        if len({s.shape_key for s in states}) > 1:
            raise ValueError("step: states of different shapes cannot share a forward")
        moving = [s for s in states if not s.done and float(s.schedule.dt(s.step)) != 0.0]
        if moving:
            x, t, cap = [], [], []
            for s in moving:
                lat = s.latents.to(self.dtype).unsqueeze(2)
                if s.reference is not None:
                    lat = torch.cat([lat, s.reference.unsqueeze(2)], dim=2)
                time = s.schedule.model_time(s.step).to(self.device)
                rows = 2 if s.cfg else 1
                x += [lat] * rows
                t += [time] * rows
                cap.append(s.caption)
                if s.cfg:
                    cap.append(self._negative_row.expand_as(s.caption))
            caches = [c for s in moving for c in s.block_cache[: 2 if s.cfg else 1]]
            out = self.models.dit(torch.cat(x), torch.cat(t), torch.cat(cap), caches, self.first_block_cache)[
                :, :, 0
            ].float()
            row = 0
            for s in moving:
                pos = out[row : row + 1]
                if s.cfg:
                    neg = out[row + 1 : row + 2]
                    pos = pos + s.spec.guidance_scale * (pos - neg)
                row += 2 if s.cfg else 1
                s.latents = s.latents + s.schedule.dt(s.step).to(self.device) * (-pos)
                s.forwards += 1
        for s in states:
            if not s.done:
                s.step += 1
        return len(moving), sum(2 if s.cfg else 1 for s in moving)

    @torch.inference_mode()
    def decode(self, state: DenoiseState) -> torch.Tensor:
        """Finished latents → uint8 RGB [bucket h, bucket w, 3] on the CPU."""
        return images.to_uint8(self.models.vae.decode(state.latents))
