"""Start-up progress of a stage → its phase reporter (status file, Describe, Health): one interface for
every stage, the thinker's ranks included (`services/thinker/group/startup.py` calls the same methods)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from omnistage.common.runtime.server import ServiceRuntime

# What a stage's stress reports each attempt to: (phase, detail), `StageProgress.in_phase`.
Report = Callable[[str, str], None]


class Failure(Protocol):
    """A failure that names the rank at fault (a TP group's GroupFailure)."""

    @property
    def message(self) -> str: ...
    @property
    def rank(self) -> int: ...


class StageProgress:
    """What start-up code reports while it works; every call is also a heartbeat (the stuck timer)."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.reporter = runtime.reporter

    def enter(self, phase: str, total: int = 0, unit: str = "", detail: str = "") -> None:
        """A new start-up phase, with fresh progress counted in `unit` (shards, attempts)."""
        self.reporter.enter(phase, total=total, unit=unit, detail=detail)

    def step(self, detail: str, done: int = 0, total: int = 0) -> None:
        """A step within the current phase (a shape, an attempt): `done` of `total` (0: not counted)."""
        self.reporter.progress(done, total=total or None, detail=detail)

    def heartbeat(self, detail: str) -> None:
        """Working on `detail`, nothing counted (encoding the preset voices, capturing graphs)."""
        self.reporter.heartbeat(detail)

    def shards(self, done: int, total: int) -> None:
        """Weight loading: `done` of `total` shards read (a loader's `progress` callback)."""
        self.reporter.progress(done, total=total, detail=f"{done}/{total} shards")

    def in_phase(self, phase: str, detail: str) -> None:
        """Working on `detail` in `phase`: enters it when not in it yet, else a heartbeat that keeps the
        count (a stress's attempts report here)."""
        if self.reporter.phase != phase:
            self.reporter.enter(phase, detail=detail)
        else:
            self.reporter.heartbeat(detail)

    def failed(self, failure: Failure) -> None:
        """The process failed because of `failure`, blaming the rank it names."""
        self.runtime.fail(failure.message, failure.rank)
