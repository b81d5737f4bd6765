"""After start-up (`supervision:`): how a hung or dead service is noticed and restarted."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.common.config.checks import ConfigError, positive_fields


@dataclass(frozen=True)
class SupervisionConfig:
    """After start-up: how a hung or dead service is noticed and restarted instead of ending `serve`."""

    # How often each process writes its liveness heartbeat into its status file (from its event
    # loop: a stopped or stuck loop stops it).
    heartbeat_interval_s: float = 1.0
    # A ready process whose heartbeat (or health answer, rank 0) is older than this is hung.
    heartbeat_timeout_s: float = 10.0
    # How often the launcher asks each ready service's health (non-blocking, deadline rpc_timeout_s).
    health_interval_s: float = 2.0
    # Restarts of one service within restart_window_s; one more failure stops everything (exit 1).
    # 0: never restart (the first failure after ready ends `serve`).
    max_restarts: int = 5
    restart_window_s: float = 600.0
    # Delay before restart k (1-based) within the window: backoff_initial_s * 2^(k-1), capped.
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0

    def validate(self, path: str) -> None:
        positive_fields(
            self,
            path,
            (
                "heartbeat_interval_s",
                "heartbeat_timeout_s",
                "health_interval_s",
                "restart_window_s",
                "backoff_max_s",
            ),
        )
        positive_fields(self, path, ("max_restarts", "backoff_initial_s"), allow_zero=True)
        if self.heartbeat_interval_s >= self.heartbeat_timeout_s:
            raise ConfigError(
                f"{path}.heartbeat_interval_s: must be below heartbeat_timeout_s "
                f"({self.heartbeat_timeout_s:g}), got {self.heartbeat_interval_s:g}"
            )
