"""Start-up: its phases, their deadlines (`startup:`) and the test hook that breaks one (`fault:`)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from omnistage.common.config.checks import ConfigError, positive, positive_fields

Phase = Literal["starting", "loading_weights", "profiling_memory", "warming_up", "capturing_graphs"]
STARTUP_PHASES: tuple[str, ...] = typing.get_args(Phase)


@dataclass(frozen=True)
class FaultConfig:
    """Test hook: make this service misbehave in one start-up phase (chaos and launcher tests)."""

    phase: Phase = "loading_weights"
    # hang: sleep forever (no progress); crash: exit(3); oom: raise a simulated out-of-memory;
    # delay: sleep `delay_s` then continue normally.
    action: Literal["hang", "crash", "oom", "delay"] = "hang"
    # TP rank that misbehaves; -1 means every rank.
    rank: int = -1
    delay_s: float = 1.0
    # Where inside the phase an `oom` fires; "" means on entering the phase. Thinker only:
    # "kv_rebuild" / "kv_validation" (profiling_memory: a peer takes the device's free memory just
    # before the KV rebuild or the validation stress, so the allocation itself fails),
    # "warmup_forward" (warming_up: an out-of-memory error half-way through the first warm-up forward).
    at: Literal["", "kv_rebuild", "kv_validation", "warmup_forward"] = ""

    def validate(self, path: str, kind: str, tp_size: int) -> None:
        """Of a service of `kind` with `tp_size` ranks."""
        if not -1 <= self.rank < tp_size:
            raise ConfigError(f"{path}.rank: expected -1 (every rank) or 0..{tp_size - 1}, got {self.rank}")
        positive(f"{path}.delay_s", self.delay_s, allow_zero=True)
        if not self.at:
            return
        if kind != "thinker" or self.action != "oom":
            raise ConfigError(f"{path}.at: only for action oom of a thinker (got {self.action} of a {kind})")
        if self.phase != _FAULT_POINT_PHASES[self.at]:
            raise ConfigError(
                f"{path}.at: {self.at} happens in phase {_FAULT_POINT_PHASES[self.at]}, not {self.phase}"
            )


_FAULT_POINT_PHASES = {
    "kv_rebuild": "profiling_memory",
    "kv_validation": "profiling_memory",
    "warmup_forward": "warming_up",
}


@dataclass(frozen=True)
class StartupConfig:
    """Deadlines of start-up: every wait has one (a lost 'ready' must never hang the launcher)."""

    # Longest time a service may spend in each phase, in seconds.
    phase_deadlines_s: dict[str, float] = field(
        default_factory=lambda: {
            "starting": 60.0,
            "loading_weights": 900.0,
            "profiling_memory": 600.0,
            "warming_up": 600.0,
            "capturing_graphs": 600.0,
        }
    )
    # A start-up phase whose progress heartbeat is older than this is reported stuck (after ready:
    # supervision.heartbeat_timeout_s).
    heartbeat_timeout_s: float = 120.0
    # Launcher poll period of each service's Describe.
    poll_interval_s: float = 0.2
    # Deadline of one Describe/health call.
    rpc_timeout_s: float = 2.0
    # SIGTERM → SIGKILL grace when the launcher stops children.
    stop_grace_s: float = 15.0
    # How much of the warm-up and stress-and-cap a service on a plain CPU runs (see `full_warmup`):
    # minimal (each path proven once) | full (every shape and batch, as on an accelerator).
    cpu_warmup: Literal["minimal", "full"] = "minimal"

    def full_warmup(self, device: str, simulated_capacity_bytes: int = 0) -> bool:
        """Whether a service on `device` runs its full warm-up and stress. They exist to build kernels
        and to prove the stage's largest batch within its device memory: on an accelerator and on a
        simulated device (memory.simulated_capacity_bytes: a budget to prove) always. A plain CPU has
        neither (torch eager, no budget: the full stress can only conclude its largest batch), so it
        runs each path once unless `cpu_warmup: full` asks for the rest (tests of those phases)."""
        plain_cpu = device.split(":")[0] == "cpu" and not simulated_capacity_bytes
        return not plain_cpu or self.cpu_warmup == "full"

    def validate(self, path: str) -> None:
        positive_fields(self, path, ("heartbeat_timeout_s", "poll_interval_s", "rpc_timeout_s"))
        positive(f"{path}.stop_grace_s", self.stop_grace_s, allow_zero=True)
        for phase in self.phase_deadlines_s:
            if phase not in STARTUP_PHASES:
                raise ConfigError(
                    f"{path}.phase_deadlines_s.{phase}: unknown phase (known: {', '.join(STARTUP_PHASES)})"
                )
        for phase, value in self.phase_deadlines_s.items():
            positive(f"{path}.phase_deadlines_s.{phase}", value)
