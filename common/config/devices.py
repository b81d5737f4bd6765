"""The host's GPUs as the launcher's memory ledger sees them, and CUDA MPS (`devices:`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omnistage.common.config.checks import positive_fields


@dataclass(frozen=True)
class MpsConfig:
    """CUDA MPS, so that stage processes sharing a GPU run their kernels side by side (common/mps.py)."""

    # "auto": a daemon when a GPU hosts more than one stage process, else none; a daemon that cannot
    # start is a warning (the stages time-slice the GPU as without MPS). "on": a daemon for any CUDA
    # stage, and `serve` fails when it cannot start. "off": never.
    mode: Literal["auto", "on", "off"] = "auto"
    # The control program (PATH is searched).
    control_binary: str = "nvidia-cuda-mps-control"
    # How long the daemon may take to open its control pipe, and to quit at the end, in seconds.
    start_timeout_s: float = 30.0
    stop_timeout_s: float = 30.0

    def validate(self, path: str) -> None:
        positive_fields(self, path, ("start_timeout_s", "stop_timeout_s"))


@dataclass(frozen=True)
class DevicesConfig:
    """The GPUs of the host, as the launcher's memory ledger sees them."""

    # Bytes of every GPU left out of all budgets (CUDA contexts, NCCL, fragmentation).
    reserve_bytes: int = 0
    # Total bytes of each GPU used by the ledger instead of what the driver reports; 0 asks torch.cuda.
    total_bytes_override: int = 0
    mps: MpsConfig = field(default_factory=MpsConfig)

    def validate(self, path: str) -> None:
        positive_fields(self, path, ("reserve_bytes", "total_bytes_override"), allow_zero=True)
        self.mps.validate(f"{path}.mps")
