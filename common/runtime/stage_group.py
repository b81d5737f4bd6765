"""StageGroup: the agreement steps of the ranks of one stage that start together, as hooks of the boot.

A single-device stage is a group of one: every hook does nothing. A TP group (the thinker's ranks)
joins at the start of loading, tells every rank which phase it is in (so a failure names it), turns a
rank's failure into the group's one diagnostic (rank, phase, cause) that every rank leaves with, and
agrees that start-up is over before the first request runs through the whole group.
"""

from __future__ import annotations


class StageGroup:
    """The hooks `common/runtime/boot.py` calls at each step of start-up; the default: a rank alone.

    `join`, `started` and `failure` may block (collectives with deadlines): the boot calls them off the
    event loop. `enter` must not block.
    """

    def join(self) -> None:
        """Before anything loads, on the start-up thread: meet the other ranks (a rendezvous)."""

    def enter(self, phase: str) -> None:
        """This rank enters `phase` (told before the phase reporter, whose fault hook may fire in it)."""

    def started(self) -> None:
        """Every rank has finished its warm-up: the group's last start-up agreement."""

    def failure(self, exc: Exception) -> Exception:
        """The error this rank leaves with when `exc` ends its start-up: alone, `exc` itself; in a group,
        the group's first failure, which every rank reports alike."""
        return exc
