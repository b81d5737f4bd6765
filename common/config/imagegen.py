"""The image-generation stage (`imagegen:`): sizes, steps, guidance, requests denoised together."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omnistage.common.config.checks import ConfigError, batch_sizes, positive, positive_fields

IMAGE_SIZE_MULTIPLE = 16  # the Z-Image VAE's 8x times the DiT's 2x2 patch


@dataclass(frozen=True)
class ImageGenConfig:
    """Image-generation service limits: sizes, steps, guidance, how many requests denoise together."""

    # Resolution bucket table the DiT generates at: 512, 672 or 1024 (the model's; 1:1 → highres²).
    highres: int = 1024
    # Smallest / largest width or height a request may ask for, in pixels (multiples of 16).
    min_side_px: int = 64
    max_side_px: int = 2048
    # Width and height of a request that gives 0.
    default_side_px: int = 1024
    # Denoising steps of a request that leaves them unset, and the most it may ask for.
    default_steps: int = 30
    max_steps: int = 100
    # Guidance scale of a request that leaves it unset, and the largest accepted.
    default_guidance_scale: float = 2.0
    max_guidance_scale: float = 20.0
    # Accept reference images (edits); the start-up stress then includes the reference frame.
    allow_edits: bool = True
    # Largest reference image accepted, width × height as its header says (checked before decoding).
    max_reference_pixels: int = 67_108_864
    # Concurrent requests (one DiT forward) the start-up stress tries, largest first, at the largest
    # bucket with guidance (and a reference frame with allow_edits); the largest that fits is the cap.
    stress_batch_sizes: tuple[int, ...] = (8, 4, 2, 1)
    # Requests waiting for a slot beyond the running ones before RESOURCE_EXHAUSTED.
    max_queued_requests: int = 64
    # How long a request waits for a slot before RESOURCE_EXHAUSTED, in seconds.
    queue_timeout_s: float = 60.0
    # Threads decoding conditioning and reference images and encoding PNGs.
    postprocess_workers: int = 2
    # First-block cache threshold (0: off, the exact forward): a denoising step whose first DiT layer's
    # residual changed by less than this (relative mean) since the last full step reuses the rest.
    first_block_cache: float = 0.0

    def validate(self, path: str) -> None:
        if self.highres not in (512, 672, 1024):
            raise ConfigError(
                f"{path}.highres: expected 512, 672 or 1024 (the model's bucket tables), got {self.highres}"
            )
        positive_fields(
            self,
            path,
            (
                "min_side_px",
                "max_side_px",
                "default_side_px",
                "default_steps",
                "max_steps",
                "max_reference_pixels",
                "queue_timeout_s",
                "postprocess_workers",
            ),
        )
        positive(f"{path}.max_queued_requests", self.max_queued_requests, allow_zero=True)
        positive(f"{path}.first_block_cache", self.first_block_cache, allow_zero=True)
        for key in ("min_side_px", "max_side_px", "default_side_px"):
            if getattr(self, key) % IMAGE_SIZE_MULTIPLE:
                raise ConfigError(
                    f"{path}.{key}: expected a multiple of {IMAGE_SIZE_MULTIPLE}, got {getattr(self, key)}"
                )
        self._validate_defaults(path)
        batch_sizes(f"{path}.stress_batch_sizes", self.stress_batch_sizes)

    def _validate_defaults(self, path: str) -> None:
        """A request's defaults lie within its limits."""
        if not self.min_side_px <= self.default_side_px <= self.max_side_px:
            raise ConfigError(
                f"{path}.default_side_px: {self.default_side_px} is outside [min_side_px {self.min_side_px}, "
                f"max_side_px {self.max_side_px}]"
            )
        if self.default_steps > self.max_steps:
            raise ConfigError(
                f"{path}.default_steps: {self.default_steps} exceeds max_steps {self.max_steps}"
            )
        if not (math.isfinite(self.max_guidance_scale) and self.max_guidance_scale >= 0):
            raise ConfigError(
                f"{path}.max_guidance_scale: expected a finite number >= 0, got {self.max_guidance_scale}"
            )
        if not 0 <= self.default_guidance_scale <= self.max_guidance_scale:
            raise ConfigError(
                f"{path}.default_guidance_scale: expected 0..max_guidance_scale ({self.max_guidance_scale}), "
                f"got {self.default_guidance_scale}"
            )
