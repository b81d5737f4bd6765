"""Flow-match Euler schedule as the reference pipeline sets it up (ming.md §6.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from omnistage.services.imagegen.models.config import SchedulerConfig


def calculate_shift(image_seq_len: int, cfg: SchedulerConfig) -> float:
    """mu: linear in the image token count between (base_image_seq_len, base_shift) and (max_.., max_shift)."""
    m = (cfg.max_shift - cfg.base_shift) / (cfg.max_image_seq_len - cfg.base_image_seq_len)
    b = cfg.base_shift - m * cfg.base_image_seq_len
    return image_seq_len * m + b


@dataclass(frozen=True)
class Schedule:
    """sigmas [steps + 1] and timesteps [steps] (0..1000), float32 on the CPU."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    @property
    def steps(self) -> int:
        return int(self.timesteps.shape[0])

    def model_time(self, i: int) -> torch.Tensor:
        """The DiT's time input at step i: (1000 − timestep) / 1000, float32 (0 = noise, 1 = clean)."""
        return (1000 - self.timesteps[i : i + 1]) / 1000

    def dt(self, i: int) -> torch.Tensor:
        return self.sigmas[i + 1] - self.sigmas[i]


def make_schedule(cfg: SchedulerConfig, steps: int, image_seq_len: int) -> Schedule:
    """The schedule of one request: `steps` Euler steps for an image of `image_seq_len` DiT tokens."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sigma_max = 1.0  # the first training sigma, shifted or not, is exactly 1
    timesteps = np.linspace(sigma_max * cfg.num_train_timesteps, 0.0, steps)
    sigmas = timesteps / cfg.num_train_timesteps
    with np.errstate(divide="ignore"):
        if cfg.use_dynamic_shifting:
            mu = calculate_shift(image_seq_len, cfg)
            if cfg.time_shift_type == "exponential":
                sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
            else:
                sigmas = mu / (mu + (1 / sigmas - 1))
        else:
            sigmas = cfg.shift * sigmas / (1 + (cfg.shift - 1) * sigmas)
    s = torch.from_numpy(sigmas).to(torch.float32)
    return Schedule(sigmas=torch.cat([s, torch.zeros(1)]), timesteps=s * cfg.num_train_timesteps)
