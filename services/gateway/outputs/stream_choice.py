"""Which talker stream a spoken answer's speech gets: a slot of the `talker` gate (the streams of the
replicas that are up), at once or within `talker_stream_wait_s`, on the least loaded replica with a
credit; never a replica lost under this speech. A speech whose replica was lost waits ahead of the
answers whose audio has not begun. When there is none, `NoStream` says why, naming the replica lost."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from omnistage.common.runtime.errors import DeadlineExceeded, Overloaded
from omnistage.services.gateway.admission import Slot, StageGate
from omnistage.services.gateway.replicas import Replicas, in_flight_share
from omnistage.services.gateway.stages import TalkerClient
from omnistage.v1 import omni_pb2

if TYPE_CHECKING:
    from omnistage.services.gateway.ticket import Ticket

# Pushback a client gets when this gateway holds all the talker's streams (the talker's own).
NO_CREDIT_RETRY_MS = 500

_talker_load = in_flight_share(lambda t: t.max_streams)


class Speech(Protocol):
    """What a speech needs of the talker's side of the gateway (outputs/talker.py's SpeechStage)."""

    kind: str
    limits: Any  # SpeechLimits
    replicas: Replicas[TalkerClient]
    gate: StageGate

    def observe(self, status: omni_pb2.AudioStatus) -> None: ...

    def moved(self, lost: str) -> None: ...


@dataclass(frozen=True)
class NoStream:
    """Why a speech has no (more) stream: its AudioStatus code, message and retry hint."""

    code: str
    message: str
    retry_after_ms: int = 0


class StreamChoice:
    """The streams of one answer's speech, and the replicas lost under it (`lost`, by name)."""

    def __init__(self, stage: Speech, ticket: Ticket) -> None:
        self.stage = stage
        self.ticket = ticket
        self.lost: list[str] = []

    def usable(self) -> list[TalkerClient]:
        """The replicas the speech may speak on: those up, but for any lost under it."""
        return [t for t in self.stage.replicas.up() if t.name not in self.lost]

    async def take(self, lost: str, last: TalkerClient) -> tuple[Slot, TalkerClient] | NoStream:
        """A stream and its replica; `lost`: how `last`, the replica the speech spoke on, was lost ('' for
        the speech's first stream)."""
        replicas, gate, wait_s = self.stage.replicas, self.stage.gate, self.stage.limits.stream_wait_s
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_s
        while usable := self.usable():
            try:
                slot = await self.ticket.join(
                    self.stage.kind, max(0.0, until - loop.time()), first=bool(lost)
                )
            except (Overloaded, DeadlineExceeded) as exc:
                wait_ms = getattr(exc, "retry_after_ms", 0) or int(gate.estimated_wait_s(coming=False) * 1000)
                none = "freed" if isinstance(exc, DeadlineExceeded) else "is expected to free"
                why = (
                    f"{self.stage.kind}: all {gate.cfg.max_running} streams are speaking and none {none} "
                    f"within {wait_s:g}s (gateway.talker_stream_wait_s)"
                )
                return NoStream("RESOURCE_EXHAUSTED", after(lost, why), max(1, wait_ms))
            talker = replicas.pick(_talker_load, lambda t: t.has_credit() and t in usable)
            if talker is not None:
                return slot, talker
            # The slot was given back by a call on a replica found down since: the gate has shrunk,
            # and the stream is waited for again (none when the gate still has room: every replica up
            # is full, its credits not counted by the gate).
            slot.release()
            if gate.has_room() and (usable := self.usable()):
                full = ", ".join(f"{t.name}: all {t.max_streams} streams are speaking" for t in usable)
                return NoStream("RESOURCE_EXHAUSTED", after(lost, full), NO_CREDIT_RETRY_MS)
        return NoStream("UNAVAILABLE", self._none_up(lost, last))

    def _none_up(self, lost: str, last: TalkerClient) -> str:
        """Why no replica can take the speech: every one down (each says why), or, after `last` was
        `lost`, no other one up."""
        replicas = self.stage.replicas
        if not lost:
            return replicas.unavailable().args[0]
        if len(replicas) == 1:
            return lost
        others = "; ".join(
            f"'{t.name}': {t.down_reason or 'lost under this speech'}"
            for t in replicas.clients
            if t is not last
        )
        return after(lost, f"no other {self.stage.kind} replica is up ({others})")


def after(lost: str, why: str) -> str:
    """Why there is no (more) speech: `why`, after the replica lost under it when there was one."""
    return f"{lost}; the speech could not go on: {why}" if lost else why
