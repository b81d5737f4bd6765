"""A service's device-memory budget (`memory:`)."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.common.config.checks import ConfigError, positive_fields


@dataclass(frozen=True)
class MemoryConfig:
    """Device-memory budget of one service (per TP rank, on the device that rank runs on)."""

    # Bytes this service may hold on its device; 0 means no byte budget.
    budget_bytes: int = 0
    # Fraction (0, 1] of its device's total memory; 0 means none. At most one of the two is set.
    budget_fraction: float = 0.0
    # CPU only: account memory against a simulated device of this many bytes (CI); 0 turns it off.
    simulated_capacity_bytes: int = 0

    @property
    def has_budget(self) -> bool:
        return self.budget_bytes > 0 or self.budget_fraction > 0

    def budget_of(self, device_total: int) -> int:
        """The budget in bytes on a device of `device_total` bytes (0 when none is set)."""
        if self.budget_bytes:
            return self.budget_bytes
        return int(self.budget_fraction * device_total)

    def validate(self, path: str, device: str) -> None:
        """Of a service on `device` (cpu | cuda)."""
        positive_fields(self, path, ("budget_bytes", "simulated_capacity_bytes"), allow_zero=True)
        if not 0 <= self.budget_fraction <= 1:
            raise ConfigError(
                f"{path}.budget_fraction: expected a number in [0, 1], got {self.budget_fraction}"
            )
        if self.budget_bytes and self.budget_fraction:
            raise ConfigError(f"{path}.budget_bytes: set budget_bytes or budget_fraction, not both")
        if self.simulated_capacity_bytes and device != "cpu":
            raise ConfigError(f"{path}.simulated_capacity_bytes: only for device cpu (got device {device})")
        if self.has_budget and device == "cpu" and not self.simulated_capacity_bytes:
            raise ConfigError(f"{path}: a budget on device cpu needs simulated_capacity_bytes > 0")
        if (
            self.budget_bytes
            and self.simulated_capacity_bytes
            and self.budget_bytes > self.simulated_capacity_bytes
        ):
            raise ConfigError(
                f"{path}.budget_bytes: {self.budget_bytes} exceeds simulated_capacity_bytes "
                f"{self.simulated_capacity_bytes}"
            )
