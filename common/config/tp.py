"""Deadlines of the thinker's tensor-parallel group (`tp:`)."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.common.config.checks import ConfigError, positive_fields


@dataclass(frozen=True)
class TPConfig:
    """Deadlines of a tensor-parallel group (thinker): no rank ever waits for a peer without one."""

    # Deadline of the rendezvous and of every collective during start-up (a slow rank's weight
    # loading is waited for here, so it is long).
    startup_collective_timeout_s: float = 900.0
    # Deadline of every collective while serving (step plan broadcast, the forward's all-reduces);
    # idle workers get a keep-alive plan every quarter of it.
    serving_collective_timeout_s: float = 120.0
    # Once a rank has failed, died or stopped answering, every rank of the group exits within this.
    failure_exit_s: float = 30.0
    # How often each rank writes its heartbeat and reads its peers' (and the group's first failure).
    peer_watch_interval_s: float = 0.5
    # A peer whose heartbeat is this old (or the store host not answering for this long) has
    # stopped answering; a dead peer process on the same host is seen within one interval.
    peer_timeout_s: float = 10.0

    def validate(self, path: str) -> None:
        positive_fields(
            self,
            path,
            (
                "startup_collective_timeout_s",
                "serving_collective_timeout_s",
                "failure_exit_s",
                "peer_watch_interval_s",
                "peer_timeout_s",
            ),
        )
        if self.peer_timeout_s < 2 * self.peer_watch_interval_s:
            raise ConfigError(
                f"{path}.peer_timeout_s: must be at least twice peer_watch_interval_s "
                f"({self.peer_watch_interval_s:g}), got {self.peer_timeout_s:g}"
            )
        least = self.peer_timeout_s + 2 * self.peer_watch_interval_s
        if self.failure_exit_s < least:
            raise ConfigError(
                f"{path}.failure_exit_s: must leave time after a silent peer is detected: at least peer_timeout_s "
                f"+ 2 x peer_watch_interval_s ({least:g}), got {self.failure_exit_s:g}"
            )
